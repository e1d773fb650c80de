"""Online model of what a target forward costs: time = fixed + per_token * num_tokens.

Fitted by exponentially weighted least squares on decode steps (prefill steps are left out: a
long prompt chunk would dominate the fit). The chain prices a draft token with it: with S
sequences in a step, one plain step yields S tokens in `fixed + per_token * S` seconds, so one
extra verified row costs `per_token * S / (fixed + per_token * S)` tokens' worth of time.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepCostModel:
    fixed_s: float = 8e-3  # prior: a ~8 ms decode step on this class of CPU
    per_token_s: float = 4e-4
    decay: float = 0.98  # weight of the past per new observation
    min_observations: int = 8
    # Exponentially weighted sums for the fit t = a + b n.
    _w: float = 0.0
    _n: float = 0.0
    _t: float = 0.0
    _nn: float = 0.0
    _nt: float = 0.0
    _count: int = 0

    def observe(self, num_tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + num_tokens
        self._t = d * self._t + seconds
        self._nn = d * self._nn + num_tokens * num_tokens
        self._nt = d * self._nt + num_tokens * seconds
        self._count += 1
        if self._count >= self.min_observations:
            self._refit()

    def _refit(self) -> None:
        var = self._w * self._nn - self._n * self._n
        if var <= 1e-9 * max(1.0, self._w * self._nn):
            return  # all steps had the same size: slope not identifiable yet
        b = (self._w * self._nt - self._n * self._t) / var
        a = (self._t - b * self._n) / self._w
        if b > 0 and a > 0:
            self.per_token_s, self.fixed_s = b, a

    def cost_per_token(self, num_seqs: int) -> float:
        s = max(1, num_seqs)
        return self.per_token_s * s / (self.fixed_s + self.per_token_s * s)

    def seconds_per_token(self, num_seqs: int) -> float:
        """What one generated token costs in plain decoding with `num_seqs` sequences."""
        s = max(1, num_seqs)
        return (self.fixed_s + self.per_token_s * s) / s
