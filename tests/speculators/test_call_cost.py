"""Pricing a model drafter's first forward per call: fixed + per sequence, and the ask set."""
import random

import pytest

from speculant.engine.step_cost import LineSums
from speculant.speculators.call_cost import DraftCallCost, fit_call_cost
from speculant.speculators.chain import best_ask_set


def test_fit_recovers_fixed_and_per_sequence_cost():
    cost = DraftCallCost()
    rng = random.Random(0)
    for _ in range(200):
        k = rng.randint(1, 8)
        cost.observe(k, 0.003 + 0.0002 * k)
    assert cost.known
    assert cost.fixed_s == pytest.approx(0.003, rel=1e-6)
    assert cost.per_seq_s == pytest.approx(0.0002, rel=1e-6)
    assert cost.seconds(8) == pytest.approx(0.0046, rel=1e-6) and cost.seconds(0) == 0.0


def test_one_sequence_per_call_prices_the_mean_call():
    """At c=1 the number of sequences never varies: the slope is not identifiable, and each
    sequence costs the mean call."""
    cost = DraftCallCost()
    for seconds in (0.001, 0.002, 0.0015, 0.0015):
        cost.observe(1, seconds)
    assert cost.fixed_s == 0.0
    assert cost.seconds(1) == pytest.approx(0.0015, rel=0.05)
    assert not DraftCallCost().known


@pytest.mark.parametrize("sums", [(3, 6, 0.03, 14, 0.07), (4, 4, 0.02, 4, 0.02), (0, 0, 0, 0, 0)])
def test_fit_never_reads_a_negative_part(sums):
    a, b = fit_call_cost(LineSums(*sums))
    assert a >= 0 and b >= 0


def test_calls_costlier_for_fewer_sequences_read_flat():
    a, b = fit_call_cost(LineSums(2, 9, 0.004, 65, 0.014))  # 1 seq: 3 ms, 8 seqs: 1 ms
    assert b == 0 and a == pytest.approx(0.002)


def test_best_ask_set_pays_for_the_call_together_or_not_at_all():
    values = {s: 0.3 for s in range(8)}
    call = lambda k: 1.0 + 0.05 * k  # noqa: E731  a weight read, then little per sequence
    assert sorted(best_ask_set(values, call)) == list(range(8))  # 2.4 - 1.4 > 0
    assert best_ask_set({0: 0.3, 1: 0.3}, call) == []  # 0.6 < 1.1: none
    # the best sequences first, and only while each adds more than it costs
    mixed = {0: 0.9, 1: 0.8, 2: 0.02, 3: 0.01}
    assert sorted(best_ask_set(mixed, call)) == [0, 1]
    assert best_ask_set({}, call) == []


def test_revived_rows_are_priced_at_their_mean_time_spread_over_the_asks():
    from speculant.speculators.call_cost import REVIVAL_ASKS

    cost = DraftCallCost()
    assert cost.revival_seconds(128) == 0.0  # no revival timed yet
    cost.observe_revival(0, 1.0)  # a call that revived nothing teaches nothing
    assert cost.row_s == 0.0
    for _ in range(30):
        cost.observe_revival(100, 0.004)
    assert cost.row_s == pytest.approx(4e-5, rel=1e-6)
    assert cost.revival_seconds(128) == pytest.approx(128 * 4e-5 / REVIVAL_ASKS, rel=1e-6)
