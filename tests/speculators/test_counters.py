"""AcceptanceCounters: the one definition of the speculation quantities every report shows."""
import pytest

from speculant.speculators.counters import AcceptanceCounters, total


def four_steps_two_drafts() -> AcceptanceCounters:
    """4 verification steps, two of which verified a draft: 5 tokens (3 accepted) and 2 (0)."""
    c = AcceptanceCounters()
    for _ in range(4):
        c.record_step()
    c.record_draft(5, 3)
    c.record_draft(2, 0)
    return c


def test_mean_accepted_length_is_tokens_per_verification_step():
    """1 + accepted / steps; steps without a draft count (they yield one token)."""
    c = four_steps_two_drafts()
    assert c.mean_accepted_length == pytest.approx(1 + 3 / 4)
    assert c.acceptance_rate == pytest.approx(3 / 7)


def test_mean_accepted_length_per_draft_counts_only_steps_that_verified_a_draft():
    """1 + accepted / drafts (vLLM's mean acceptance length): the steps the chain drafted
    nothing for do not dilute it, and the summary reports it beside the per-step figure."""
    c = four_steps_two_drafts()
    assert c.mean_accepted_length_per_draft == pytest.approx(1 + 3 / 2)
    assert c.mean_accepted_length_per_draft > c.mean_accepted_length
    s = c.summary()
    assert s["mean_accepted_length_per_draft"] == pytest.approx(2.5)
    assert s["mean_accepted_length"] == pytest.approx(1.75)
    assert AcceptanceCounters().summary()["mean_accepted_length_per_draft"] == 1.0


def test_no_speculation_reports_one_and_zero():
    """Plain decoding (or nothing yet): mean accepted length 1.0, acceptance rate 0.0."""
    c = AcceptanceCounters()
    assert (c.mean_accepted_length, c.acceptance_rate) == (1.0, 0.0)
    c.record_step()
    assert c.summary()["mean_accepted_length"] == 1.0


def test_total_sums_counts_and_positions():
    """Totals add counts and per-position lists of different lengths."""
    a, b = AcceptanceCounters(), AcceptanceCounters()
    a.record_step(), a.record_draft(3, 3)
    b.record_step(), b.record_draft(1, 1)
    t = total([a, b])
    assert (t.num_steps, t.num_drafts, t.num_draft_tokens, t.num_accepted_tokens) == (2, 2, 4, 4)
    assert t.accepted_per_pos == [2, 1, 1]


def test_impossible_record_is_refused():
    """More accepted than drafted is a bug in the caller, named."""
    with pytest.raises(ValueError, match="accepted"):
        AcceptanceCounters().record_draft(2, 3)
