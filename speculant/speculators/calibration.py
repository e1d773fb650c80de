"""How often a model drafter's tokens are accepted, by the probability the drafter gave them.

Measured on the 6,305 held-out positions of the target's greedy answers (the held-out set of
`speculant train-head`), the shipped EAGLE-3 head's top-1 probability is close to calibrated: its first
draft tokens with probability 0.1-0.2 were right 16% of the time, 0.3-0.4 38%, 0.5-0.6 59%,
0.7-0.8 75%, 0.9-1.0 97% (the second position alike). Priced by its average acceptance (0.41)
averaged with that probability, the chain verified the head about as often when it was unsure
as when it was sure, and asked it to draft by its average alone.

So acceptance is learned per probability bin for each model drafter, from its verified drafts
and from its scored (unverified) proposals alike, each bin starting from the drafter's own
probability as its prior (`BIN_WEIGHT` pseudo-counts), so a calibrated drafter is trusted at
once and a miscalibrated one is corrected within a few dozen tokens. A sequence on which the
drafter does better or worse than that (a language it knows less) scales the rate by its
observed / predicted accepted tokens. The distribution of first-token probabilities is kept
too: it prices *asking* the drafter before its draft is seen (`value_of_first`).

A sequence's scale starts from the drafter's record on the text served lately
(`WorkloadScale`: every sequence's judged tokens, fading over WORKLOAD_TOKENS predicted ones),
not from 1: on retrieved text (rag at c=1) the chain asks the shipped head a couple of times a
request, where the model-free drafts have nothing, and there its first tokens were right 26%
of the time against the ~60% its chat calibration predicts (AMD EPYC Zen 4, 16 prompts: 40
calls of ~2 ms, 11 of 43 tokens accepted); a scale that starts at 1 in every request, with a
couple of asks to learn from, never saw that.

Before MIN_FIRST first tokens are seen asking is not priced, and a drafter whose first few
drafts missed could stay unpriced for good: in a fresh engine on summarization (the n-gram
chain drafting most steps) the shipped head was asked twice in 4 prompts and never again. A
head made by `speculant train-head` ships the first-token calibration measured on its held-out
answers (`CalibrationPrior`, in its recipe.json); the chain starts from it at the weight of
PRIOR_FIRST first tokens, so the head is priced from the first round and what the live
drafts show soon outweighs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

NUM_BINS = 10  # probability bins [0, 0.1), ..., [0.9, 1]
BIN_WEIGHT = 4.0  # pseudo-counts of the drafter's own probability inside a bin's estimate
SEQ_WEIGHT = 4.0  # pseudo-tokens at the workload's ratio inside a sequence's observed / predicted
# predicted tokens over which the workload's record fades (`WorkloadScale`): a few requests' asks
WORKLOAD_TOKENS = 32.0
MIN_FIRST = 8  # first-token probabilities seen before they price asking the drafter
PRIOR_FIRST = float(MIN_FIRST)  # first tokens' worth of a shipped calibration prior


def bin_of(p: float) -> int:
    return min(NUM_BINS - 1, max(0, int(p * NUM_BINS)))


def _zeros() -> list[float]:
    return [0.0] * NUM_BINS


@dataclass(frozen=True, slots=True)
class CalibrationPrior:
    """A drafter's first draft tokens where it was made (a head's held-out answers): per
    probability bin, their share, mean probability and how often the target agreed."""

    share: tuple[float, ...]
    mean_prob: tuple[float, ...]
    rate: tuple[float, ...]

    @classmethod
    def from_table(cls, table: dict) -> "CalibrationPrior":
        """From the recipe's `first_token_calibration` {"share", "mean_prob", "rate"}, each a
        list over the NUM_BINS bins (ValueError naming what does not fit)."""
        cols = []
        for key in ("share", "mean_prob", "rate"):
            col = table.get(key) if isinstance(table, dict) else None
            if not isinstance(col, list) or len(col) != NUM_BINS:
                raise ValueError(f"first_token_calibration.{key} must be a list of {NUM_BINS} "
                                 f"numbers, got {col!r}")
            if not all(isinstance(v, (int, float)) and 0.0 <= v <= 1.0 for v in col):
                raise ValueError(f"first_token_calibration.{key} values must be in [0, 1]")
            cols.append(tuple(float(v) for v in col))
        if abs(sum(cols[0]) - 1.0) > 1e-3:
            raise ValueError(f"first_token_calibration.share must sum to 1, got {sum(cols[0]):.4f}")
        return cls(*cols)


def first_token_table(probs: list[float], agree: list[bool]) -> dict:
    """The `CalibrationPrior` table of first draft tokens with these probabilities, `agree`
    where the target's token was the same: per bin their share, mean probability and rate
    (a bin without tokens: share 0, its middle as mean probability, rate = that)."""
    if len(probs) != len(agree) or not probs:
        raise ValueError(f"need as many agreements as probabilities (>0), got {len(probs)} "
                         f"and {len(agree)}")
    num, psum, hits = _zeros(), _zeros(), _zeros()
    for p, a in zip(probs, agree):
        b = bin_of(p)
        num[b] += 1
        psum[b] += p
        hits[b] += float(a)
    mid = [(b + 0.5) / NUM_BINS for b in range(NUM_BINS)]
    mean = [psum[b] / num[b] if num[b] else mid[b] for b in range(NUM_BINS)]
    return {"share": [round(n / len(probs), 4) for n in num],
            "mean_prob": [round(m, 4) for m in mean],
            "rate": [round(hits[b] / num[b], 4) if num[b] else round(mean[b], 4)
                     for b in range(NUM_BINS)]}


@dataclass(slots=True)
class ProbCalibration:
    """One model drafter's acceptance by probability bin, over every sequence: over all judged
    positions, and over first draft tokens alone (`first_rate`)."""

    reached: list[float] = field(default_factory=_zeros)  # judged tokens (earlier ones all right)
    accepted: list[float] = field(default_factory=_zeros)  # ... of them right
    reached_first: list[float] = field(default_factory=_zeros)  # judged first draft tokens
    accepted_first: list[float] = field(default_factory=_zeros)  # ... of them right
    first: list[float] = field(default_factory=_zeros)  # first draft tokens proposed
    first_prob: list[float] = field(default_factory=_zeros)  # ... the sum of their probabilities
    # `first_rates` as of the last record (read every round, changed only by a judged or
    # proposed token: a head the chain rarely asks recomputed it ~500 times per prompt)
    _first_rates: list | None = field(default=None, repr=False, compare=False)
    _first_best: float = field(default=0.0, repr=False, compare=False)  # their highest rate

    def rate(self, p: float) -> float:
        """Expected acceptance of a token the drafter gave probability p (its earlier tokens
        right), any position: the bin's record, shrunk towards p."""
        b = bin_of(p)
        return (self.accepted[b] + BIN_WEIGHT * p) / (self.reached[b] + BIN_WEIGHT)

    def first_rate(self, p: float) -> float:
        """The same for a first draft token: the bin's first-token record, shrunk towards the
        bin's rate over all positions. (Pooled with the later positions, a head's unsure first
        tokens looked better than they were: on summarization, where the n-gram chain leaves
        the head the text it does not copy, its verified first tokens at p 0.1-0.2 were right
        15% of the time while the pooled bin read 30%, as later tokens at that probability,
        judged only after right ones, were right more often.)"""
        b = bin_of(p)
        return (self.accepted_first[b] + BIN_WEIGHT * self.rate(p)) / \
            (self.reached_first[b] + BIN_WEIGHT)

    def rate_at(self, p: float, pos: int) -> float:
        """Expected acceptance of draft position `pos` (0 = first) given probability p."""
        return self.first_rate(p) if pos == 0 else self.rate(p)

    def record(self, p: float, accepted: bool, pos: int = 0) -> None:
        self._first_rates = None
        b = bin_of(p)
        self.reached[b] += 1
        self.accepted[b] += float(accepted)
        if pos == 0:
            self.reached_first[b] += 1
            self.accepted_first[b] += float(accepted)

    @classmethod
    def seeded(cls, prior: CalibrationPrior | None, weight: float = PRIOR_FIRST
               ) -> "ProbCalibration":
        """Counts that start from `prior` at `weight` first tokens (none: empty counts)."""
        cal = cls()
        if prior is None:
            return cal
        total = sum(prior.share)
        for b in range(NUM_BINS):
            n = weight * prior.share[b] / total
            cal.first[b], cal.first_prob[b] = n, n * prior.mean_prob[b]
            cal.reached[b], cal.accepted[b] = n, n * prior.rate[b]
            cal.reached_first[b], cal.accepted_first[b] = n, n * prior.rate[b]
        return cal

    def record_first(self, p: float) -> None:
        self._first_rates = None
        b = bin_of(p)
        self.first[b] += 1
        self.first_prob[b] += p

    def value_of_first(self, threshold: float, scale: float = 1.0) -> float | None:
        """Expected net gain of asking for a first draft token that is verified only where it
        beats `threshold` (verification cost, plus what a rival draft would gain):
        sum over bins of share x max(0, rate - threshold). None before MIN_FIRST tokens."""
        first = self.first_rates()
        return None if first is None else value_of_first(first, threshold, scale)

    def first_rates(self) -> list[tuple[float, float]] | None:
        """(share of first tokens, expected acceptance) per bin that has first tokens, the
        part of `value_of_first` shared by every sequence of a round (None before MIN_FIRST
        first tokens). Computed per sequence, it was 1.2% of a c=8 run's time where the
        chain priced the 4-layer draft out at every step."""
        if self._first_rates is None:
            num = sum(self.first)
            if num + 1e-6 < MIN_FIRST:  # (a prior's PRIOR_FIRST tokens, summed in floats)
                return None
            self._first_rates = [
                (self.first[b] / num, self.first_rate(self.first_prob[b] / self.first[b]))
                for b in range(NUM_BINS) if self.first[b]]
            self._first_best = max(rate for _, rate in self._first_rates)
        return self._first_rates

    def value_bound(self, threshold: float, scale: float = 1.0) -> float | None:
        """An upper bound of `value_of_first` (its shares sum to 1): what the best bin's rate
        gains beyond `threshold`, without a pass over the bins (None before MIN_FIRST first
        tokens). Where a rival draft leaves less than a call's share to gain, this settles it."""
        if self.first_rates() is None:
            return None
        return max(0.0, min(1.0, scale * self._first_best) - threshold)


def value_of_first(first_rates: list[tuple[float, float]], threshold: float,
                   scale: float = 1.0) -> float:
    """`ProbCalibration.value_of_first` from its `first_rates`, with a sequence's `scale`."""
    return sum(share * max(0.0, min(1.0, scale * rate) - threshold)
               for share, rate in first_rates)


@dataclass(slots=True)
class WorkloadScale:
    """A drafter's accepted tokens and the rates predicted for them over every sequence's
    recent judged tokens (each record fades by WORKLOAD_TOKENS per predicted token): how much
    better or worse than its calibration the drafter does on the text being served lately. A
    new sequence's scale starts from it (`SeqCalibration`)."""

    accepted: float = 0.0
    predicted: float = 0.0

    def record(self, rate: float, hit: bool) -> None:
        keep = max(0.0, 1.0 - rate / WORKLOAD_TOKENS)
        self.accepted = keep * self.accepted + float(hit)
        self.predicted = keep * self.predicted + rate

    @property
    def ratio(self) -> float:
        return (self.accepted + SEQ_WEIGHT) / (self.predicted + SEQ_WEIGHT)


@dataclass(slots=True)
class SeqCalibration:
    """One sequence's record against a drafter's calibration: accepted tokens and the sum of
    the rates predicted for them; its scale starts from the `workload`'s (1 without one) at
    SEQ_WEIGHT predicted tokens."""

    accepted: float = 0.0
    predicted: float = 0.0
    workload: WorkloadScale | None = None

    @property
    def scale(self) -> float:
        prior = 1.0 if self.workload is None else self.workload.ratio
        return (self.accepted + SEQ_WEIGHT * prior) / (self.predicted + SEQ_WEIGHT)


def record_judged(cal: ProbCalibration, seq: SeqCalibration, token_probs: list[float],
                  known: int, accepted: int, first_pos: int = 0) -> None:
    """A draft with `token_probs` judged on its first `known` positions, the first `accepted`
    right: positions up to the first miss were reached (each right or wrong), later ones not.
    `first_pos`: the draft position of token_probs[0] (a trimmed draft's next token is judged
    alone, at its own position)."""
    for i in range(min(known, accepted + 1, len(token_probs))):
        p, hit, pos = token_probs[i], i < accepted, first_pos + i
        rate = cal.rate_at(p, pos)
        seq.predicted += rate
        seq.accepted += float(hit)
        if seq.workload is not None:
            seq.workload.record(rate, hit)
        cal.record(p, hit, pos)


@dataclass(frozen=True, slots=True)
class Survival:
    """One sequence's view of a model drafter's calibration, for the drafter itself: the chance
    a token it gave probability p at draft position `pos` is accepted (its earlier tokens
    right), and the least probability with a given chance.

    A drafter cuts its run where the chance the run survives no longer pays for verifying the
    next token (`DraftBuilder`, p_min_run). Measured with the product of its raw
    probabilities, the shipped EAGLE-3 head (under-confident: tokens at 0.2-0.3 right 42% of
    the time, 0.3-0.4 57%) cut runs early: 1.82-1.90 tokens per step on mt_bench and qa at c=1;
    with calibrated chances its runs are as long as they pay."""

    cal: ProbCalibration
    scale: float  # the sequence's observed / predicted accepted tokens (SeqCalibration)

    def rate(self, p: float, pos: int) -> float:
        return min(1.0, self.scale * self.cal.rate_at(p, pos))

    def least_prob(self, chance: float, pos: int) -> float:
        """The least probability p with rate(p, pos) >= chance (> 1: none). Within a bin the
        rate is linear in p (the bin's record shrunk towards p), so each bin is solved."""
        if chance <= 0.0:
            return 0.0
        need = chance / self.scale
        for b in range(NUM_BINS):
            lo, hi = b / NUM_BINS, (b + 1) / NUM_BINS
            base, slope = self._line(b, pos)  # rate_at(p, pos) = base + slope * p in bin b
            p = (need - base) / slope
            if p <= lo:
                return lo
            if p <= hi and (p < hi or b == NUM_BINS - 1):
                return p
        return float("inf")

    def _line(self, b: int, pos: int) -> tuple[float, float]:
        cal = self.cal
        base, slope = cal.accepted[b] / (cal.reached[b] + BIN_WEIGHT), \
            BIN_WEIGHT / (cal.reached[b] + BIN_WEIGHT)
        if pos == 0:  # first tokens: the first-token record, shrunk towards that line
            w = cal.reached_first[b] + BIN_WEIGHT
            base, slope = (cal.accepted_first[b] + BIN_WEIGHT * base) / w, BIN_WEIGHT * slope / w
        return base, slope


def calibrated_rates(cal: ProbCalibration, seq: SeqCalibration,
                     token_probs: list[float]) -> list[float]:
    """a_i of a drafted run of tokens: each token's bin rate at its position, scaled by the
    sequence's record."""
    scale = seq.scale
    return [min(1.0, scale * cal.rate_at(p, i)) for i, p in enumerate(token_probs)]
