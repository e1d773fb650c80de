"""Whether a model drafter runs a further forward: a draft's `need` matches `takes`, a token's
gain is what it adds past the break-even, a record stops forwards that gain less than they cost,
and explores them now and then."""
import random

from speculant.speculators.base import DraftBuilder, DraftParams
from speculant.speculators.continuation import (EXPLORE_EVERY, MIN_GAIN, MIN_SEEN,
                                                ContinuationRecord, need_bin, pays_to_continue)


def test_need_is_the_threshold_of_takes():
    rng = random.Random(3)
    for _ in range(2000):
        params = DraftParams(n_max=8, p_min=rng.choice([0.0, 0.2, 0.5]),
                             p_min_run=rng.choice([0.0, 0.1, 0.4, 0.9]))
        grow = DraftBuilder()
        for _ in range(rng.randrange(0, 4)):
            grow.add(1, rng.random(), None)
        need, prob = grow.need(params), rng.random()
        # floats: a product exactly at the floor may round either way
        if abs(prob - need) > 1e-9:
            assert grow.takes(prob, params) == (prob >= need)


def test_need_above_one_when_the_run_fell_below_its_floor():
    grow = DraftBuilder()
    params = DraftParams(n_max=4, p_min_run=0.5)
    assert grow.need(params) == 0.0  # the first token needs p_min only
    grow.add(7, 0.4, None)
    assert grow.need(params) > 1.0  # 0.4 x p < 0.5 for every p <= 1
    assert not ContinuationRecord().worth(grow.need(params))


def test_gain_is_the_run_past_the_break_even():
    params = DraftParams(n_max=4, p_min=0.1, p_min_run=0.2)
    grow = DraftBuilder()
    grow.add(5, 0.8, None)
    assert abs(grow.gain(0.5, params) - (0.8 * 0.5 - 0.2)) < 1e-12
    assert grow.gain(0.2, params) == 0.0  # 0.16 < 0.2: does not join
    assert grow.gain(0.05, params) == 0.0  # below p_min
    assert abs(grow.gain(0.3, DraftParams(n_max=4)) - 0.24) < 1e-12  # no floor: the run itself


def test_a_bin_that_gains_less_than_a_forward_costs_forwards_only_to_explore():
    record = ContinuationRecord()
    for i in range(int(MIN_SEEN) * 2):
        record.record(0.85, gain=0.1 if i % 8 == 0 else 0.0)  # 0.0125 per forward
        record.record(0.35, gain=0.3 if i % 8 != 0 else 0.0)  # 0.26 per forward
    cost = 0.1
    b = need_bin(0.85)
    assert not pays_to_continue(record.forwards[b], record.gains[b], cost)
    asked = [record.worth(0.85, cost) for _ in range(4 * EXPLORE_EVERY)]
    assert sum(asked) == 4  # every EXPLORE_EVERY-th: the bin's gain can recover
    assert record.num_skipped == 4 * EXPLORE_EVERY - 4
    assert all(record.worth(0.35, cost) for _ in range(10))  # a paying bin always forwards
    assert record.worth(0.65, cost)  # unseen: measured first


def test_the_same_record_pays_at_a_low_cost_only():
    record = ContinuationRecord()
    for _ in range(int(MIN_SEEN) * 2):
        record.record(0.45, gain=0.12)
    assert record.worth(0.45, 0.1)
    assert not record.worth(0.45, 0.2)
    # a forward of unknown cost (0) still has to gain MIN_GAIN
    thin = ContinuationRecord()
    for _ in range(int(MIN_SEEN) * 2):
        thin.record(0.45, gain=MIN_GAIN / 4)
    assert not thin.worth(0.45, 0.0)


def test_a_bin_recovers_once_its_forwards_gain_again():
    record = ContinuationRecord()
    for _ in range(int(MIN_SEEN) + 1):  # (counts decay: MIN_SEEN forwards count a bit less)
        record.record(0.75, gain=0.0)
    assert not record.worth(0.75, 0.05)
    for _ in range(int(MIN_SEEN)):  # the explored forwards now yield tokens
        record.record(0.75, gain=0.2)
    assert record.worth(0.75, 0.05)
