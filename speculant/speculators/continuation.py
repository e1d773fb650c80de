"""Whether a model drafter runs one more forward for a draft: its record of how often the next
token reached the probability the draft needed.

A model drafter learns its next token only by running a forward for it, and the token joins
the draft only if its probability reaches `need` (`DraftBuilder.need`: p_min, and the run's
product staying above the chain's break-even p_min_run). Where `need` > 1 no token can join.
Below that the forward is a bet: on mt_bench (SmolLM2-135M, the shipped EAGLE-3 head, 6 prompts,
the chain pricing the head) 41% of the head's further forwards had need > 1, and of the rest
the share that yielded a token rose with need falling: 7-25% for need 0.5-1, 42-62% for need
0.4-0.5, 88% below 0.33. A forward costs a layer and the LM head (~0.3-0.9 ms against a 5 ms
target step on 2 cores), a token taken is worth a fraction of a step: forwards that yield a
token less than a third of the time lose.

So the record keeps, per bin of `need`, how many forwards ran and how many yielded a token
(decayed, so it follows the text), and a bin whose rate fell below MIN_TAKE_RATE forwards only
every EXPLORE_EVERY-th time (its rate can recover).
"""
from __future__ import annotations

from dataclasses import dataclass, field

NUM_BINS = 10  # bins of need: [0, 0.1), [0.1, 0.2), ..., [0.9, 1]
MIN_TAKE_RATE = 1.0 / 3.0
MIN_SEEN = 16.0  # forwards in a bin before its rate decides
EXPLORE_EVERY = 8
DECAY = 1.0 - 1.0 / 512  # per forward recorded in the bin


def need_bin(need: float) -> int:
    return min(NUM_BINS - 1, max(0, int(need * NUM_BINS)))


def pays_to_continue(forwards: float, taken: float) -> bool:
    """A bin's record: forwards run and tokens they yielded -> whether forwards there pay (an
    unseen bin does: it has to be measured)."""
    return forwards < MIN_SEEN or taken >= MIN_TAKE_RATE * forwards


@dataclass(slots=True)
class ContinuationRecord:
    forwards: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)
    taken: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)
    skips: list[int] = field(default_factory=lambda: [0] * NUM_BINS)
    num_skipped: int = 0  # forwards not run (need > 1 or a losing bin)

    def worth(self, need: float) -> bool:
        """Whether to run the forward for a next token that joins only at probability >= need."""
        if need > 1.0:
            self.num_skipped += 1
            return False
        b = need_bin(need)
        if pays_to_continue(self.forwards[b], self.taken[b]):
            return True
        self.skips[b] += 1
        if self.skips[b] % EXPLORE_EVERY == 0:
            return True
        self.num_skipped += 1
        return False

    def record(self, need: float, taken: bool) -> None:
        """A forward run at `need` yielded a token (or not)."""
        b = need_bin(need)
        self.forwards[b] = self.forwards[b] * DECAY + 1.0
        self.taken[b] = self.taken[b] * DECAY + float(taken)
