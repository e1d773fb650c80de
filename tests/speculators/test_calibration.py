"""Model drafters' acceptance by the probability they gave their tokens (calibration.py), and
how the chain prices their drafts and asks with it."""
import pytest

from speculant.speculators.base import Draft, DraftBuilder, DraftParams, DraftRequest, Speculator
from speculant.speculators.calibration import (BIN_WEIGHT, MIN_FIRST, WORKLOAD_TOKENS,
                                               ProbCalibration, SeqCalibration, Survival,
                                               WorkloadScale, calibrated_rates, record_judged)
from speculant.speculators.chain import SpeculatorChain


def test_a_bin_starts_at_the_drafters_probability_and_learns_what_it_sees():
    cal = ProbCalibration()
    assert cal.rate(0.93) == pytest.approx(0.93) and cal.rate(0.15) == pytest.approx(0.15)
    for _ in range(40):  # over-confident in [0.9, 1]: right one time in four
        cal.record(0.95, False)
        cal.record(0.95, False)
        cal.record(0.95, False)
        cal.record(0.95, True)
    assert cal.rate(0.95) == pytest.approx((40 + BIN_WEIGHT * 0.95) / (160 + BIN_WEIGHT))
    assert cal.rate(0.35) == pytest.approx(0.35)  # other bins untouched


def test_judged_draft_records_positions_up_to_the_first_miss():
    cal, seq = ProbCalibration(), SeqCalibration()
    record_judged(cal, seq, [0.95, 0.85, 0.55, 0.45], known=4, accepted=2)
    assert cal.reached[9] == cal.accepted[9] == 1 and cal.reached[8] == cal.accepted[8] == 1
    assert cal.reached[5] == 1 and cal.accepted[5] == 0  # the miss
    assert cal.reached[4] == 0  # after the miss: never reached
    assert seq.accepted == 2 and seq.predicted == pytest.approx(0.95 + 0.85 + 0.55)
    record_judged(cal, seq, [0.9, 0.9], known=1, accepted=1)  # censored after one known token
    assert cal.reached[9] == 2


def test_a_sequence_where_the_drafter_does_worse_scales_its_rates_down():
    cal, seq, other = ProbCalibration(), SeqCalibration(), SeqCalibration()
    assert calibrated_rates(cal, seq, [0.8, 0.5]) == pytest.approx([0.8, 0.5])
    for i in range(50):  # elsewhere its tokens at 0.8 are right 4 times in 5
        record_judged(cal, other, [0.8], known=1, accepted=int(i % 5 != 0))
    for _ in range(20):
        record_judged(cal, seq, [0.8], known=1, accepted=0)
    rates = calibrated_rates(cal, seq, [0.8, 0.5])
    assert rates[0] < 0.3 and rates[1] < 0.5 * 0.5
    assert calibrated_rates(cal, other, [0.8])[0] > 0.5


def test_a_new_sequence_starts_from_how_the_drafter_did_on_the_recent_ones():
    """Requests after requests where the drafter's tokens at 0.8 were right 1 time in 5 (the
    head on retrieved text, where its chat calibration overrates it) start their scale there,
    not at 1; once the text turns (right 4 times in 5), the next requests start near 1 again
    within a few dozen predicted tokens."""
    cal, workload = ProbCalibration.seeded(None), WorkloadScale()
    for i in range(200):  # calibration learned on chat: right 4 times in 5
        record_judged(cal, SeqCalibration(), [0.8], known=1, accepted=int(i % 5 != 0))
    assert SeqCalibration(workload=workload).scale == pytest.approx(1.0)
    for r in range(8):  # 8 requests of hard text, 5 judged tokens each
        seq = SeqCalibration(workload=workload)
        for i in range(5):
            record_judged(cal, seq, [0.8], known=1, accepted=int(i == 0))
    fresh = SeqCalibration(workload=workload)
    assert fresh.scale < 0.5
    assert calibrated_rates(cal, fresh, [0.8])[0] < 0.5 * calibrated_rates(cal, SeqCalibration(),
                                                                           [0.8])[0]
    turned = 0
    while SeqCalibration(workload=workload).scale < 0.85:
        seq = SeqCalibration(workload=workload)
        record_judged(cal, seq, [0.8], known=1, accepted=int(turned % 5 != 0))
        turned += 1
    assert turned <= 2 * WORKLOAD_TOKENS
    # a sequence's own record still outweighs the workload's once it has one
    own = SeqCalibration(workload=workload)
    for _ in range(40):
        record_judged(cal, own, [0.8], known=1, accepted=0)
    assert own.scale < 0.2


def test_first_tokens_are_calibrated_apart_from_later_positions():
    """Later tokens are judged only after right ones: at the same probability they can be right
    far more often than first tokens, which price asking the drafter and verifying its draft."""
    cal = ProbCalibration()
    for i in range(100):  # first tokens at 0.15 right 1 time in 10; second ones 6 in 10
        record_judged(cal, SeqCalibration(), [0.15], known=1, accepted=int(i % 10 == 0))
        record_judged(cal, SeqCalibration(), [0.95, 0.15], known=2, accepted=1 + int(i % 10 < 6))
    assert cal.reached_first[1] == 100 and cal.accepted_first[1] == 10
    assert cal.reached[1] == 200 and cal.accepted[1] == 70  # pooled: 35%
    assert cal.first_rate(0.15) == pytest.approx((10 + BIN_WEIGHT * cal.rate(0.15)) /
                                                 (100 + BIN_WEIGHT))
    first, second = calibrated_rates(cal, SeqCalibration(), [0.15, 0.15])
    assert first == pytest.approx(0.1, abs=0.05) and second > 0.3
    for _ in range(MIN_FIRST):
        cal.record_first(0.15)
    assert cal.first_rates()[0][1] == pytest.approx(first)  # asking is priced by first tokens


def test_first_rates_follow_every_record():
    """`first_rates` (read every round) reflects each judged and each proposed first token
    as soon as it is recorded."""
    import dataclasses

    def recomputed(cal):
        return dataclasses.replace(cal, _first_rates=None).first_rates()

    cal = ProbCalibration()
    for _ in range(MIN_FIRST):
        cal.record_first(0.45)
    before = cal.first_rates()
    for _ in range(20):
        cal.record(0.45, False, pos=0)
    judged = cal.first_rates()
    assert judged == recomputed(cal) and judged[0][1] < before[0][1]
    cal.record_first(0.95)
    assert cal.first_rates() == recomputed(cal) and len(cal.first_rates()) == 2


def test_value_of_asking_counts_only_tokens_worth_verifying():
    cal = ProbCalibration()
    assert cal.value_of_first(0.3) is None  # nothing seen yet
    for _ in range(MIN_FIRST):
        cal.record_first(0.95)  # half the first tokens are sure...
        cal.record_first(0.05)  # ...half are not (never worth a row at cost 0.3)
    assert cal.value_of_first(0.3) == pytest.approx(0.5 * (0.95 - 0.3))
    assert cal.value_of_first(0.99) == 0.0


def test_the_value_bound_never_undercuts_the_value_and_follows_every_record():
    """`value_bound` (the best bin's gain, what `_outbid` checks before the pass over the
    bins) is never below `value_of_first` for any threshold and scale, equals it when every
    first token falls in one bin, and moves with the records as the value does."""
    import random

    rng = random.Random(7)
    cal = ProbCalibration()
    assert cal.value_bound(0.3) is None
    for _ in range(MIN_FIRST):
        cal.record_first(0.95)
    for t in (0.0, 0.3, 0.9, 1.2):
        assert cal.value_bound(t) == pytest.approx(cal.value_of_first(t))
    for _ in range(300):
        p = rng.random()
        if rng.random() < 0.5:
            cal.record_first(p)
        else:
            cal.record(p, rng.random() < p, pos=0)
        t, scale = rng.uniform(0.0, 1.1), rng.uniform(0.3, 1.5)
        assert cal.value_bound(t, scale) >= cal.value_of_first(t, scale) - 1e-12
    cal.record_first(0.05)  # a new unsure bin lowers the value; the best bin stays
    best = max(rate for _, rate in cal.first_rates())
    assert cal.value_bound(0.2) == pytest.approx(max(0.0, min(1.0, best) - 0.2))


def test_draft_builder_stops_where_the_run_no_longer_pays():
    params = DraftParams(n_max=8, p_min_run=0.3)
    grow = DraftBuilder()
    assert grow.takes(0.2, params)  # the first token is always kept (p_min 0)
    grow.add(1, 0.9, None)
    grow = DraftBuilder()
    grow.add(1, 0.9, None)
    assert grow.takes(0.5, params)  # 0.45 >= 0.3
    grow.add(2, 0.5, None)
    assert not grow.takes(0.6, params)  # 0.27 < 0.3
    with pytest.raises(ValueError, match="p_min_run"):
        DraftParams(p_min_run=1.5)


def under_confident_calibration() -> ProbCalibration:
    """A drafter whose tokens at probability ~0.3 are right 60% of the time, at ~0.5 80%
    (the shipped EAGLE-3 head is under-confident like this), first tokens and later alike."""
    cal = ProbCalibration()
    for p, rate in ((0.35, 0.6), (0.55, 0.8)):
        for i in range(100):
            cal.record(p, i % 10 < rate * 10, pos=0)
            cal.record(p, i % 10 < rate * 10, pos=1)
    return cal


def test_survival_least_prob_inverts_the_calibrated_rate():
    survival = Survival(under_confident_calibration(), scale=1.0)
    for pos in (0, 1, 3):
        for chance in (0.05, 0.3, 0.5, 0.62, 0.75, 0.79):
            p = survival.least_prob(chance, pos)
            assert p <= 1.0 and survival.rate(p, pos) >= chance - 1e-9
            # nothing below it reaches the chance
            assert all(survival.rate(q / 1000, pos) < chance for q in range(int(p * 1000) - 1))
    assert survival.least_prob(0.0, 1) == 0.0
    assert survival.least_prob(0.99, 1) == pytest.approx(0.99)  # an unseen bin: p itself
    assert Survival(under_confident_calibration(), scale=0.5).least_prob(0.6, 1) > 1.0  # none
    assert Survival(under_confident_calibration(), scale=0.5).least_prob(0.35, 1) > \
        survival.least_prob(0.35, 1)  # a sequence where it does worse needs more


def test_draft_builder_runs_on_calibrated_chances():
    """With the drafter's calibration, a run of an under-confident drafter's tokens at 0.35
    survives with chance 0.6 each, so three join under p_min_run 0.2 (0.35 x 0.35 = 0.12
    would have stopped it after one); the continuation need is the least such probability."""
    raw, calibrated = DraftParams(n_max=8, p_min_run=0.2), DraftParams(
        n_max=8, p_min_run=0.2, survival=Survival(under_confident_calibration(), scale=1.0))
    for params, expected in ((raw, 1), (calibrated, 3)):
        grow = DraftBuilder()
        while len(grow.ids) < 8 and grow.takes(0.35, params):
            grow.add(len(grow.ids), 0.35, None, grow.chance(0.35, params))
        assert len(grow.ids) == expected
    grow = DraftBuilder()
    grow.add(1, 0.35, None, grow.chance(0.35, calibrated))
    need = grow.need(calibrated)
    assert grow.takes(need + 1e-6, calibrated) and not grow.takes(need - 0.02, calibrated)
    assert grow.need(calibrated) == pytest.approx(0.3)  # where the 60% bin starts
    assert grow.need(raw) == pytest.approx(0.2 / grow.run_prob)


class ConfidentModel(Speculator):
    """A model drafter copying `text` whose first token has probability `p` and is right
    with probability ~p (every 1/(1-p)-th such token is wrong), later tokens 0.9 and right."""

    is_model_based = True

    def __init__(self, name, text, probs):
        self.name, self.text, self.probs = name, text, probs  # probs: position -> p of token 0
        self.asked: list[DraftParams] = []

    def begin(self, seq_id, prompt_ids):
        pass

    def draft(self, requests):
        out = {}
        for r in requests:
            self.asked.append(r.params)
            pos = len(r.token_ids)
            p, right = self.probs(pos)
            grow = DraftBuilder()
            for i in range(r.params.n_max):
                tok = self.text[pos + i] if (i > 0 or right) else 99999
                prob = p if i == 0 else 0.9
                if not grow.takes(prob, r.params):
                    break
                grow.add(tok, prob, None)
            out[r.seq_id] = grow.to_draft()
        return out

    def accept(self, seq_id, num_accepted, is_other):
        pass

    def end(self, seq_id):
        pass


def drive(chain, text, start, rounds, cost=0.3):
    from test_chain import run_like_the_engine  # this folder is on sys.path (rootdir conftest)
    return run_like_the_engine(chain, text, start, rounds, cost=cost)


def test_the_chain_verifies_a_calibrated_drafters_sure_tokens_not_its_unsure_ones():
    """Half the positions the model is sure (p 0.95, right), half unsure (p 0.1, wrong).
    Priced by its calibration the chain verifies the sure drafts and none of the unsure ones,
    where its average (0.5) alone would have verified both or neither."""
    text = list(range(2000, 4000))
    model = ConfidentModel("model", text, lambda pos: (0.95, True) if pos % 2 else (0.1, False))
    chain = SpeculatorChain([model], probe_interval=1000)
    chain.begin(0, text[:10], ("model",))
    drive(chain, text, 10, 60)
    stats = chain.stats["model"]
    assert stats.num_drafts > 10 and stats.num_accepted_tokens >= stats.num_drafts
    # unsure first tokens were never verified: every verified draft had its first token right
    assert stats.accepted_per_pos[0] == stats.num_drafts
    assert model.asked[-1].p_min_run > 0  # asked to stop where the run stops paying


def test_an_over_confident_drafter_is_priced_out_by_what_it_shows():
    """A model that gives p 0.95 to wrong first tokens: after a few verified misses its
    calibration bin falls, and the chain stops verifying (and asking, but for shadow drafts)."""
    text = list(range(5000, 7000))
    model = ConfidentModel("model", text, lambda pos: (0.95, False))
    chain = SpeculatorChain([model], probe_interval=1000)
    chain.begin(0, text[:10], ("model",))
    lengths = drive(chain, text, 10, 40)
    assert lengths[0] > 0 and max(lengths[-20:]) == 0
    assert chain.stats["model"].num_drafts <= 12


def test_a_priced_drafter_rereads_only_a_window_of_a_history_it_missed():
    """A priced model drafter asked again after 100 plain steps of a sequence (the tuner decoded
    plain) re-reads only the last PROBE_CONTEXT_TOKENS of it, not all it missed; its next ask
    continues from there, and a new sequence's first priced ask still reads its whole prompt."""
    from speculant.speculators.base import CommittedTokens
    from speculant.speculators.chain import PROBE_CONTEXT_TOKENS

    text = list(range(2000, 4000))
    model = ConfidentModel("model", text, lambda pos: (0.95, True))
    chain = SpeculatorChain([model], probe_interval=1000)
    chain.begin(0, text[:10], ("model",))
    drive(chain, text, 10, 20)
    assert model.asked[-1].context_tokens == 0  # priced and current: its own context
    pos = 10 + chain.stats["model"].num_accepted_tokens + 20  # where drive left seq 0
    for _ in range(100):  # plain steps
        chain.process([CommittedTokens(0, pos - 1, text[pos - 1:pos], text[pos])])
        pos += 1
    assert chain.draft([DraftRequest(0, text[:pos], DraftParams(n_max=4))], 0.3)
    assert model.asked[-1].context_tokens == PROBE_CONTEXT_TOKENS
    chain.process([CommittedTokens(0, pos - 1, text[pos - 1:pos + 4], text[pos + 4])])
    pos += 5
    chain.draft([DraftRequest(0, text[:pos], DraftParams(n_max=4))], 0.3)
    assert model.asked[-1].context_tokens == 0
    chain.begin(1, text[:300], ("model",))
    chain.draft([DraftRequest(1, text[:300], DraftParams(n_max=4))], 0.3)
    assert model.asked[-1].context_tokens == 0


def test_a_priced_first_read_of_a_sequence_that_generated_past_a_window_reads_the_window():
    """A sequence that decoded plain past a window before a priced model drafter was first
    asked about it (it joined while the tuner decoded plain) is read from the window, not from
    its prompt on; one that generated less than a window still reads its whole history."""
    from speculant.speculators.base import CommittedTokens
    from speculant.speculators.chain import PROBE_CONTEXT_TOKENS

    text = list(range(2000, 4000))
    model = ConfidentModel("model", text, lambda pos: (0.95, True))
    chain = SpeculatorChain([model], probe_interval=1000)
    chain.begin(0, text[:10], ("model",))
    drive(chain, text, 10, 20)  # priced now
    for seq_id, generated, window in ((1, PROBE_CONTEXT_TOKENS + 40, PROBE_CONTEXT_TOKENS),
                                      (2, PROBE_CONTEXT_TOKENS - 4, 0)):
        start = 100 * seq_id
        chain.begin(seq_id, text[start:start + 50], ("model",))
        end = start + 50
        for _ in range(generated):  # plain steps, the drafter not asked
            chain.process([CommittedTokens(seq_id, end - start - 1, text[end - 1:end], text[end])])
            end += 1
        assert chain.draft([DraftRequest(seq_id, text[start:end], DraftParams(n_max=4))], 0.3)
        assert model.asked[-1].context_tokens == window


def test_first_token_table_bins_probabilities_and_their_agreement():
    from speculant.speculators.calibration import first_token_table

    table = first_token_table([0.05, 0.15, 0.18, 0.95, 0.97], [False, True, False, True, True])
    assert sum(table["share"]) == pytest.approx(1.0)
    assert table["share"][1] == pytest.approx(0.4) and table["rate"][1] == pytest.approx(0.5)
    assert table["mean_prob"][1] == pytest.approx(0.165)
    assert table["rate"][9] == 1.0 and table["rate"][0] == 0.0
    assert table["share"][5] == 0.0 and table["rate"][5] == pytest.approx(0.55)  # empty bin
    with pytest.raises(ValueError, match="as many"):
        first_token_table([0.5], [])


def test_prior_table_is_checked_by_name():
    from speculant.speculators.calibration import CalibrationPrior

    good = {"share": [0.1] * 10, "mean_prob": [0.5] * 10, "rate": [0.4] * 10}
    assert CalibrationPrior.from_table(good).rate == (0.4,) * 10
    with pytest.raises(ValueError, match="rate must be a list of 10"):
        CalibrationPrior.from_table(dict(good, rate=[0.4] * 9))
    with pytest.raises(ValueError, match="share must sum to 1"):
        CalibrationPrior.from_table(dict(good, share=[0.2] * 10))
    with pytest.raises(ValueError, match=r"mean_prob values must be in \[0, 1\]"):
        CalibrationPrior.from_table(dict(good, mean_prob=[1.5] * 10))


def _prior(rate_sure: float):
    """First tokens: half at p 0.05 (right 5%), half at p 0.95 (right `rate_sure`)."""
    from speculant.speculators.calibration import CalibrationPrior

    share, mean, rate = [0.0] * 10, [(b + 0.5) / 10 for b in range(10)], [0.5] * 10
    share[0], mean[0], rate[0] = 0.5, 0.05, 0.05
    share[9], mean[9], rate[9] = 0.5, 0.95, rate_sure
    return CalibrationPrior(tuple(share), tuple(mean), tuple(rate))


def test_a_seeded_calibration_prices_asking_at_once_and_live_records_outweigh_it():
    cal = ProbCalibration.seeded(_prior(0.95))
    assert cal.value_of_first(0.3) == pytest.approx(0.5 * (0.95 - 0.3), abs=0.02)
    assert ProbCalibration.seeded(None).value_of_first(0.3) is None
    for _ in range(200):  # live: every first token sure, and wrong
        cal.record_first(0.95)
        cal.record(0.95, False)
    assert cal.value_of_first(0.3) == 0.0


def test_the_chain_starts_from_a_drafters_shipped_prior():
    """A model drafter that ships a prior is priced from the first round: a prior of sure and
    right first tokens asks it at once; one whose sure tokens were wrong where it was made
    (at PRIOR_FIRST tokens' weight, beside the bins' pull towards the drafter's probability:
    rate ~0.48 < the 0.5 row cost) keeps it unasked, where a drafter without a prior gets its
    first read (at a row cost its unknown record can pay)."""
    text = list(range(2000, 4000))
    asked = {}
    for label, prior, cost in (("good", _prior(0.95), 0.5), ("bad", _prior(0.0), 0.5),
                               ("none", None, 0.3)):
        model = ConfidentModel("model", text, lambda pos: (0.95, True))
        model.calibration_prior = prior
        chain = SpeculatorChain([model], probe_interval=1000)
        assert (chain._calibration["model"].first_rates() is None) == (prior is None)
        chain.begin(0, text[:10], ("model",))
        chain.draft([DraftRequest(0, text[:10], DraftParams(n_max=4))], cost, 0.01)
        asked[label] = model.asked
    assert asked["good"] and asked["good"][0].context_tokens == 0  # priced: reads its prompt
    assert not asked["bad"]
    assert asked["none"] and asked["none"][0].context_tokens > 0  # a first read of a window


def spy_on_pricing(monkeypatch) -> list[str]:
    """The names of the model drafters the chain prices asking (`_budget_model_drafts`), as
    it does so."""
    budgeted = []
    budget = SpeculatorChain._budget_model_drafts
    monkeypatch.setattr(SpeculatorChain, "_budget_model_drafts",
                        lambda self, name, reqs, *a: budgeted.append(name) or budget(
                            self, name, reqs, *a))
    return budgeted


def test_a_priced_drafter_a_model_free_draft_outbids_is_not_even_priced(monkeypatch):
    """Where the best model-free draft's net gain beats anything a calibrated drafter's first
    token could gain, the chain neither asks the drafter nor prices asking it; where the
    model-free draft gains less, it prices and asks it."""
    from test_chain import Fixed  # this folder is on sys.path (rootdir conftest)

    text = list(range(2000, 4000))
    budgeted = spy_on_pricing(monkeypatch)
    for expected, asked in ((4.0, False), (0.2, True)):
        model = ConfidentModel("model", text, lambda pos: (0.95, True))
        model.calibration_prior = _prior(0.95)
        copier = Fixed("copy", text[10:14], expected=expected)
        chain = SpeculatorChain([model, copier], probe_interval=1000)
        chain.begin(0, text[:10], ("model", "copy"))
        budgeted.clear()
        chain.draft([DraftRequest(0, text[:10], DraftParams(n_max=4))], 0.3, 0.01)
        assert bool(model.asked) == asked and bool(budgeted) == asked


def test_skipping_the_pricing_of_an_outbid_drafter_never_changes_a_draft(monkeypatch):
    """`_outbid` skips pricing a model drafter for a sequence whose rival leaves asking it worth
    less than its share of a call: the same rounds with the shortcut and without it (every
    sequence priced) give the same winners, the same asks with the same parameters and the same
    records, over rounds of three sequences whose rival drafts, revivals and call costs
    (unknown at first, then fitted from the calls' times) vary. The shortcut must also fire."""
    import dataclasses

    from speculant.speculators.base import CommittedTokens
    from test_chain import Fixed

    class Rival(Fixed):
        """Proposes the text's next tokens, right or wrong, at a claimed gain that varies."""

        def __init__(self, text):
            super().__init__("copy", [])
            self.text = text

        def draft(self, requests):
            out = {}
            for r in requests:
                pos = len(r.token_ids)
                if pos % 7 == 3:
                    continue  # nothing to offer
                tokens = self.text[pos:pos + 3] if pos % 3 else [99999] * 3
                out[r.seq_id] = Draft(tokens, expected_accepted=(0.05, 0.2, 0.5, 1.5)[pos % 4])
            return out

    def run(shortcut: bool):
        text = list(range(3000, 6000))
        now = [0.0]
        model = ConfidentModel("model", text, lambda pos: (0.95, pos % 5 != 0) if pos % 2
                               else (0.35, pos % 3 == 0))
        model.calibration_prior = _prior(0.9)
        model.revival_rows = lambda seq_id: 0 if seq_id == 0 else 64 * (seq_id % 2)
        drafted = model.draft

        def timed_draft(requests):  # a call costs 0.4 ms plus 0.2 ms a sequence
            now[0] += 0.0004 + 0.0002 * len(requests)
            return drafted(requests)

        model.draft = timed_draft
        chain = SpeculatorChain([model, Rival(text)], probe_interval=8, clock=lambda: now[0])
        if not shortcut:
            chain._outbid = lambda *a, **k: False
        chain._call_cost["model"].row_s = 0.0005
        starts = {0: 10, 1: 1000, 2: 2000}
        pos = dict(starts)
        for s, p in pos.items():
            chain.begin(s, text[:p], ("model", "copy"))
        trace = []
        for _ in range(120):
            now[0] += 0.005
            reqs = [DraftRequest(s, text[:p], DraftParams(n_max=4)) for s, p in pos.items()]
            winners = chain.draft(reqs, 0.2, 0.004)
            committed = []
            for s, p in pos.items():
                w = winners.get(s)
                num_acc = 0
                if w is not None:
                    while num_acc < len(w) and w.token_ids[num_acc] == text[p + num_acc]:
                        num_acc += 1
                    chain.accept(s, num_acc)
                trace.append((s, None if w is None else (w.source, tuple(w.token_ids)), num_acc))
                committed.append(CommittedTokens(s, p - 1, text[p - 1:p + num_acc],
                                                 text[p + num_acc]))
                pos[s] = p + num_acc + 1
            chain.process(committed)
        stats = chain.stats["model"]
        counts = {f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)
                  if not f.name.startswith("time_")}
        return trace, [repr(a) for a in model.asked], counts

    calls = []
    outbid = SpeculatorChain._outbid
    with monkeypatch.context() as m:  # count the shortcut's verdicts
        m.setattr(SpeculatorChain, "_outbid",
                  lambda self, *a, **k: calls.append(outbid(self, *a, **k)) or calls[-1])
        fast = run(shortcut=True)
    slow = run(shortcut=False)
    assert fast == slow
    assert sum(calls) > 20 and not all(calls)  # it skipped pricing often, not always
    assert fast[2]["num_drafts"] > 5  # and the drafter still drafted


def test_a_drafter_asked_again_only_at_a_revival_cost_a_rival_covers_is_not_priced(monkeypatch):
    """A sequence the drafter stopped following costs a revival to ask; where the model-free
    draft's gain plus that revival beats the drafter's best first token, the chain skips
    pricing it, where the same draft without a revival to pay still gets it priced."""
    from test_chain import Fixed

    text = list(range(2000, 4000))
    budgeted = spy_on_pricing(monkeypatch)
    for revival_rows, priced in ((0, True), (128, False)):
        model = ConfidentModel("model", text, lambda pos: (0.95, True))
        model.calibration_prior = _prior(0.95)
        model.revival_rows = lambda seq_id, rows=revival_rows: rows
        chain = SpeculatorChain([model, Fixed("copy", text[10:11], expected=0.4)],
                                probe_interval=1000)
        chain._call_cost["model"].row_s = 0.001  # a revived row: 0.1 tokens' worth at 10 ms
        chain.begin(0, text[:10], ("model", "copy"))
        budgeted.clear()
        chain.draft([DraftRequest(0, text[:10], DraftParams(n_max=4))], 0.3, 0.01)
        assert bool(budgeted) == priced


def test_the_chain_does_not_call_a_model_drafter_for_sequences_it_does_not_follow():
    """`process` goes to a model drafter with the sequences it follows only."""
    from speculant.speculators.base import CommittedTokens

    text = list(range(2000, 4000))
    seen = []
    model = ConfidentModel("model", text, lambda pos: (0.95, True))
    model.follows = lambda seq_id: seq_id != 1
    model.process = lambda batch: seen.append([c.seq_id for c in batch])
    chain = SpeculatorChain([model], probe_interval=1000)
    for seq_id in (0, 1):
        chain.begin(seq_id, text[:10], ("model",))
    chain.process([CommittedTokens(s, 0, text[:10], text[10]) for s in (0, 1)])
    chain.process([CommittedTokens(1, 10, text[10:11], text[11])])
    assert seen == [[0]]
