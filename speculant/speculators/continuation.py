"""Whether a model drafter runs one more forward for a draft: what such forwards were worth.

A model drafter learns its next token only by running a forward for it, and the token joins
the draft only if its probability reaches `need` (`DraftBuilder.need`: p_min, and the run's
product staying above the chain's verification break-even p_min_run). Where `need` > 1 no
token can join. Below that the forward is a bet: it costs a layer and the LM head for one row
(`DraftParams.further_cost`, measured by the chain per row of further forwards, in tokens'
worth) and is worth what the token it yields adds to the draft (`DraftBuilder.gain`: the
chance the run survives through it, past what verifying it costs; 0 when it does not join).

On mt_bench (SmolLM2-135M, the shipped EAGLE-3 head, 6 prompts) 41% of the head's further
forwards had need > 1, and of the rest the share that yielded a token rose with need falling:
7-25% for need 0.5-1, 42-62% for need 0.4-0.5, 88% below 0.33. A first rule ran forwards
where they yielded a token a third of the time, with the drafter's average cost per drafted
position inside p_min_run; that average holds the first token's catch-up forward, fused
features and LM head, about twice a further forward, and a token had to pay again for the
forward already spent on it: the head drafted 1.30 tokens per draft on mt_bench at c=1.

So the record keeps, per bin of `need`, the forwards run and the gain they yielded (decayed,
so it follows the text), and a bin whose gain per forward fell below the forward's cost runs
forwards only every EXPLORE_EVERY-th time (its gain can recover).
"""
from __future__ import annotations

from dataclasses import dataclass, field

NUM_BINS = 10  # bins of need: [0, 0.1), [0.1, 0.2), ..., [0.9, 1]
MIN_SEEN = 16.0  # forwards in a bin before its gain decides
EXPLORE_EVERY = 8
DECAY = 1.0 - 1.0 / 512  # per forward recorded in the bin
# the least gain per forward (tokens' worth) a bin must yield while a forward's cost is not
# known (0): a bin whose tokens barely clear the break-even is not worth any forward
MIN_GAIN = 0.02


def need_bin(need: float) -> int:
    return min(NUM_BINS - 1, max(0, int(need * NUM_BINS)))


def pays_to_continue(forwards: float, gain: float, cost: float) -> bool:
    """A bin's record: forwards run and the gain they yielded, against what one forward costs
    (tokens' worth) -> whether forwards there pay (an unseen bin does: it has to be measured)."""
    return forwards < MIN_SEEN or gain >= max(cost, MIN_GAIN) * forwards


@dataclass(slots=True)
class ContinuationRecord:
    forwards: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)
    gains: list[float] = field(default_factory=lambda: [0.0] * NUM_BINS)
    skips: list[int] = field(default_factory=lambda: [0] * NUM_BINS)
    num_skipped: int = 0  # forwards not run (need > 1 or a losing bin)

    def worth(self, need: float, cost: float = 0.0) -> bool:
        """Whether to run a forward costing `cost` (tokens' worth) for a next token that joins
        only at probability >= need."""
        if need > 1.0:
            self.num_skipped += 1
            return False
        b = need_bin(need)
        if pays_to_continue(self.forwards[b], self.gains[b], cost):
            return True
        self.skips[b] += 1
        if self.skips[b] % EXPLORE_EVERY == 0:
            return True
        self.num_skipped += 1
        return False

    def record(self, need: float, gain: float) -> None:
        """A forward run at `need` yielded a token adding `gain` to its draft (0: none)."""
        b = need_bin(need)
        self.forwards[b] = self.forwards[b] * DECAY + 1.0
        self.gains[b] = self.gains[b] * DECAY + gain
