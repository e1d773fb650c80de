"""What asking a model drafter for first draft tokens costs: time = fixed + per_seq x sequences.

A model drafter's first forward reads all its weights once for the whole batch of sequences it
drafts for, so asking one sequence costs nearly what asking eight does. Measured with the
shipped EAGLE-3 head on SmolLM2-135M (AMD EPYC, 2 cores, 16 mt_bench prompts at c=8): a draft
call took ~3 ms, the chain's per-position price read 1.7 ms against 1.5 ms for a plain token,
so that after calls for one or two sequences no first token could pay, and after a call for
eight every sequence was asked, each priced at an eighth of the weight read. Priced per call,
the chain asks the set of sequences whose first tokens together pay for the call, or none.

Fitted by exponentially weighted least squares on (sequences asked, seconds of the first
forward); while the number of sequences has not varied (c=1) the slope is not identifiable and
the mean call prices each sequence (fixed 0).

A sequence the drafter stopped following (a feature drafter's *silent* sequence) costs more to
ask again: its first forward also computes the rows it skipped (`Speculator.revival_rows`, up to
a 128-row window). Those rows are priced per sequence at `row_s`, the mean time of a revived
row, spread over REVIVAL_ASKS asks (reviving enables the asks that follow). Left out, as the
rows of a followed sequence are (computed anyway by the drafter's batched catch-up), the chain
at c=8 on mt_bench asked 16 sequences 567 times in a run and paid 0.3 s of 0.54 s of draft calls
for catch-up rows: eagle3 read 0.93-0.95x plain (AMD EPYC, 16 prompts).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from speculant.engine.step_cost import LineSums


# a revival's rows are priced as if spread over this many asks of the sequence
REVIVAL_ASKS = 4
ROW_SMOOTHING = 0.2  # weight of a new call in the revived-row time


@dataclass(slots=True)
class DraftCallCost:
    decay: float = 0.95  # weight of the past per new call
    min_calls: int = 4  # calls seen before the fit prices anything
    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    row_s: float = 0.0  # mean time of a revived row (0 until one is seen)
    _sums: LineSums = field(default_factory=LineSums)

    @property
    def known(self) -> bool:
        return self._sums.count >= self.min_calls

    def observe(self, num_seqs: int, seconds: float) -> None:
        if num_seqs <= 0:
            return
        self._sums.add(num_seqs, seconds, self.decay)
        self.fixed_s, self.per_seq_s = fit_call_cost(self._sums)

    def observe_revival(self, num_rows: int, seconds: float) -> None:
        """A call computed `num_rows` revived rows in `seconds` (its share of the forward)."""
        if num_rows <= 0:
            return
        per = max(0.0, seconds) / num_rows
        self.row_s = per if self.row_s == 0.0 else \
            (1 - ROW_SMOOTHING) * self.row_s + ROW_SMOOTHING * per

    def revival_seconds(self, num_rows: int) -> float:
        """What reviving `num_rows` skipped rows adds to one ask (spread over REVIVAL_ASKS)."""
        return self.row_s * num_rows / REVIVAL_ASKS

    def seconds(self, num_seqs: int) -> float:
        """Expected time of a first forward for `num_seqs` sequences (0 for none)."""
        return self.fixed_s + self.per_seq_s * num_seqs if num_seqs > 0 else 0.0


def fit_call_cost(sums: LineSums) -> tuple[float, float]:
    """(fixed, per_seq) from the calls' weighted sums (x: sequences asked, t: seconds).
    Without spread in x, or with a fit that reads a negative part, the mean time per sequence
    (fixed 0): a cost never reads below what was measured on average."""
    if sums.w <= 0 or sums.x <= 0:
        return 0.0, 0.0
    fit = sums.line(1e-6)
    if fit is not None:
        a, b = fit
        if a >= 0 and b >= 0:
            return a, b
        if b < 0:  # more sequences never cost less: a flat call
            return sums.t / sums.w, 0.0
    return 0.0, sums.t / sums.x
