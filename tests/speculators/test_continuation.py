"""Whether a model drafter runs a further forward: a draft's `need` matches `takes`, a record
stops forwards that rarely yield a token, and explores them now and then."""
import random

from speculant.speculators.base import DraftBuilder, DraftParams
from speculant.speculators.continuation import (EXPLORE_EVERY, MIN_SEEN, ContinuationRecord,
                                                need_bin, pays_to_continue)


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


def test_a_bin_that_rarely_yields_a_token_forwards_only_to_explore():
    record = ContinuationRecord()
    for i in range(int(MIN_SEEN) * 2):
        record.record(0.85, taken=i % 8 == 0)  # one forward in 8 yields a token
        record.record(0.35, taken=i % 8 != 0)  # seven in 8
    assert not pays_to_continue(record.forwards[need_bin(0.85)], record.taken[need_bin(0.85)])
    asked = [record.worth(0.85) for _ in range(4 * EXPLORE_EVERY)]
    assert sum(asked) == 4  # every EXPLORE_EVERY-th: the bin's rate can recover
    assert record.num_skipped == 4 * EXPLORE_EVERY - 4
    assert all(record.worth(0.35) for _ in range(10))  # a paying bin always forwards
    assert record.worth(0.65)  # unseen: measured first


def test_a_bin_recovers_once_its_forwards_yield_again():
    record = ContinuationRecord()
    for _ in range(int(MIN_SEEN) + 1):  # (counts decay: MIN_SEEN forwards count a bit less)
        record.record(0.75, taken=False)
    assert not record.worth(0.75)
    for _ in range(int(MIN_SEEN)):  # the explored forwards now yield tokens
        record.record(0.75, taken=True)
    assert record.worth(0.75)
