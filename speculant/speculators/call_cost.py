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
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DraftCallCost:
    decay: float = 0.95  # weight of the past per new call
    min_calls: int = 4  # calls seen before the fit prices anything
    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    _w: float = 0.0
    _n: float = 0.0
    _t: float = 0.0
    _nn: float = 0.0
    _nt: float = 0.0
    _count: int = 0

    @property
    def known(self) -> bool:
        return self._count >= self.min_calls

    def observe(self, num_seqs: int, seconds: float) -> None:
        if num_seqs <= 0:
            return
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + num_seqs
        self._t = d * self._t + seconds
        self._nn = d * self._nn + num_seqs * num_seqs
        self._nt = d * self._nt + num_seqs * seconds
        self._count += 1
        self.fixed_s, self.per_seq_s = fit_call_cost(self._w, self._n, self._t, self._nn, self._nt)

    def seconds(self, num_seqs: int) -> float:
        """Expected time of a first forward for `num_seqs` sequences (0 for none)."""
        return self.fixed_s + self.per_seq_s * num_seqs if num_seqs > 0 else 0.0


def fit_call_cost(w: float, n: float, t: float, nn: float, nt: float) -> tuple[float, float]:
    """(fixed, per_seq) from weighted sums of calls (w), sequences (n), seconds (t), n^2 and n*t.
    Without spread in n, or with a fit that reads a negative part, the mean time per sequence
    (fixed 0): a cost never reads below what was measured on average."""
    if w <= 0 or n <= 0:
        return 0.0, 0.0
    var = w * nn - n * n
    if var > 1e-6 * w * nn:
        b = (w * nt - n * t) / var
        a = (t - b * n) / w
        if a >= 0 and b >= 0:
            return a, b
        if b < 0:  # more sequences never cost less: a flat call
            return t / w, 0.0
    return 0.0, t / n
