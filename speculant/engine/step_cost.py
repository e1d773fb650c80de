"""Online model of what a target forward costs: time = fixed + per_token * num_tokens.

Fitted by exponentially weighted least squares on decode steps (prefill steps are left out: a
long prompt chunk would dominate the fit). The chain prices a draft token with it: with S
sequences in a step, one plain step yields S tokens in `fixed + per_token * S` seconds, so one
extra verified row costs `per_token * S / (fixed + per_token * S)` tokens' worth of time.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class LineSums:
    """Exponentially weighted sums of observations (x, t) for a least-squares line t = a + b x:
    the weight w, and the sums of x, t, x^2 and x t. Shared by the step-cost model and
    `speculators/call_cost.py`."""

    w: float = 0.0
    x: float = 0.0
    t: float = 0.0
    xx: float = 0.0
    xt: float = 0.0
    count: int = 0

    def add(self, x: float, t: float, decay: float) -> None:
        self.w = decay * self.w + 1.0
        self.x = decay * self.x + x
        self.t = decay * self.t + t
        self.xx = decay * self.xx + x * x
        self.xt = decay * self.xt + x * t
        self.count += 1

    def line(self, min_spread: float) -> tuple[float, float] | None:
        """(a, b) of the weighted least-squares line, or None while x has no spread (relative
        variance below `min_spread`)."""
        var = self.w * self.xx - self.x * self.x
        if self.w <= 0 or var <= min_spread * max(1.0, self.w * self.xx):
            return None
        b = (self.w * self.xt - self.x * self.t) / var
        return (self.t - b * self.x) / self.w, b


@dataclass(slots=True)
class StepCostModel:
    fixed_s: float = 8e-3  # prior: a ~8 ms decode step on this class of CPU
    per_token_s: float = 4e-4
    decay: float = 0.98  # weight of the past per new observation
    min_observations: int = 8
    _sums: LineSums = field(default_factory=LineSums)

    @property
    def num_observations(self) -> int:
        return self._sums.count

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._sums.add(num_tokens, seconds, self.decay)
        if self._sums.count >= self.min_observations:
            self._refit()

    def _refit(self) -> None:
        fit = self._sums.line(1e-9)
        if fit is None:
            return  # all steps had the same size: slope not identifiable yet
        a, b = fit
        if b > 0 and a > 0:
            self.per_token_s, self.fixed_s = b, a

    def cost_per_token(self, num_seqs: int) -> float:
        s = max(1, num_seqs)
        return self.per_token_s * s / (self.fixed_s + self.per_token_s * s)

    def seconds_per_token(self, num_seqs: int) -> float:
        """What one generated token costs in plain decoding with `num_seqs` sequences."""
        s = max(1, num_seqs)
        return (self.fixed_s + self.per_token_s * s) / s
