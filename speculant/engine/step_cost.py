"""Online model of what a target forward costs: time = fixed + per_seq * S + per_row * D,

with S the sequences of a decode step and D its draft rows (tokens beyond one per sequence).
A sequence's first row reads its own KV cache (SmolLM2-135M: 23 KB per position, 9 MB at
context 400) and runs its attention; a draft row of the same sequence reuses that read and
adds only its products. Fitted by exponentially weighted least squares on decode steps (prefill
steps are left out: a long prompt chunk would dominate the fit). The chain prices a draft
token with it: with S sequences in a step, one plain step yields S tokens in
`fixed + per_seq * S` seconds, so one draft row costs `per_row * S / (fixed + per_seq * S)`
tokens' worth of time.

One slope for both (time = fixed + per_token * tokens) read the batch's tail, where sequences
finish and S falls, as the price of a row: with `ngram_mod,suffix,eagle3` on 32 mt_bench prompts
at c=8 (AMD EPYC, 2 threads) the engine priced a draft row at 1.13 ms (0.45-0.48 of a token),
where the step log's two-slope fit read 0.71 ms per draft row and 1.47 ms per sequence (0.32).
While S has not varied (c=1) per_seq keeps its prior and `fixed` absorbs the rest; while no
step drafted, per_row keeps its prior.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this much weight of recent steps with draft rows (exponentially weighted like the fit:
# ~1 drafting step in 25 at decay 0.98), the row price fitted from them fades back to its prior,
# in proportion: the chain drafts only what that price lets through, so a price fitted too high
# gets no new evidence against it. Measured (`speculant bench`, interleaved, AMD EPYC Zen 4,
# mt_bench, c=1, `ngram_mod,suffix`, untuned): one repeat's fit read a row at 1.58 plain steps
# early on, the chain then drafted twice in 3,513 steps (0.97x plain), the other repeat 1.29x.
# Kept as fitted, such a price stays for good: once the drafting steps' weight decays, nothing
# identifies the row slope, and the last fit is kept.
MIN_ROW_WEIGHT = 2.0


@dataclass(slots=True)
class LineSums:
    """Exponentially weighted sums of observations (x, t) for a least-squares line t = a + b x:
    the weight w, and the sums of x, t, x^2 and x t (`speculators/call_cost.py`'s fit; the
    step-cost model below fits a plane, `PlaneSums`)."""

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
class PlaneSums:
    """Exponentially weighted sums of observations (s, d, t) for a least-squares plane
    t = a + b s + c d."""

    w: float = 0.0
    s: float = 0.0
    d: float = 0.0
    t: float = 0.0
    ss: float = 0.0
    dd: float = 0.0
    sd: float = 0.0
    st: float = 0.0
    dt: float = 0.0
    count: int = 0

    def add(self, s: float, d: float, t: float, decay: float) -> None:
        self.w = decay * self.w + 1.0
        self.s = decay * self.s + s
        self.d = decay * self.d + d
        self.t = decay * self.t + t
        self.ss = decay * self.ss + s * s
        self.dd = decay * self.dd + d * d
        self.sd = decay * self.sd + s * d
        self.st = decay * self.st + s * t
        self.dt = decay * self.dt + d * t
        self.count += 1


def fit_plane(sums: PlaneSums, b_prior: float, c_prior: float, min_spread: float = 1e-6,
              fit_c: bool = True) -> tuple[float, float, float] | None:
    """(a, b, c) of the weighted least-squares plane t = a + b s + c d. A slope whose input has
    not varied (relative variance below `min_spread`), or c with `fit_c` False, takes its prior
    and the others fit the rest; None when neither input has varied."""
    if sums.w <= 0:
        return None
    ms, md, mt = sums.s / sums.w, sums.d / sums.w, sums.t / sums.w
    vss, vdd = sums.ss / sums.w - ms * ms, sums.dd / sums.w - md * md
    vsd = sums.sd / sums.w - ms * md
    vst, vdt = sums.st / sums.w - ms * mt, sums.dt / sums.w - md * mt
    s_varies = vss > min_spread * max(1.0, sums.ss / sums.w)
    d_varies = fit_c and vdd > min_spread * max(1.0, sums.dd / sums.w)
    det = vss * vdd - vsd * vsd
    if s_varies and d_varies and det > min_spread * vss * vdd:
        b, c = (vst * vdd - vdt * vsd) / det, (vdt * vss - vst * vsd) / det
    elif d_varies:
        b = b_prior
        c = (vdt - b * vsd) / vdd
    elif s_varies:
        c = c_prior
        b = (vst - c * vsd) / vss
    else:
        return None
    return mt - b * ms - c * md, b, c


@dataclass(slots=True)
class StepCostModel:
    fixed_s: float = 8e-3  # prior: a ~8 ms decode step on this class of CPU
    per_seq_s: float = 4e-4
    per_row_s: float = 4e-4
    decay: float = 0.98  # weight of the past per new observation
    min_observations: int = 8
    _sums: PlaneSums = field(default_factory=PlaneSums)
    _row_weight: float = 0.0  # decayed count of observed steps with draft rows
    _prior_row_s: float = field(init=False, default=0.0)
    _fitted_row_s: float = field(init=False, default=0.0)  # the last fit from drafting steps

    def __post_init__(self) -> None:
        self._prior_row_s = self._fitted_row_s = self.per_row_s

    @property
    def num_observations(self) -> int:
        return self._sums.count

    def observe(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """A decode step of `num_seqs` sequences and `num_tokens` rows took `seconds`."""
        self._sums.add(num_seqs, num_tokens - num_seqs, seconds, self.decay)
        self._row_weight = self.decay * self._row_weight + (num_tokens > num_seqs)
        if self._sums.count >= self.min_observations:
            self._refit()

    def _refit(self) -> None:
        """Fit the plane; while few recent steps drafted (`MIN_ROW_WEIGHT`), the row price is
        the last one fitted faded towards the prior, and the rest is fitted around it."""
        evidence = min(1.0, self._row_weight / MIN_ROW_WEIGHT)
        row_s = self._prior_row_s + evidence * (self._fitted_row_s - self._prior_row_s)
        fit = fit_plane(self._sums, self.per_seq_s, row_s, fit_c=evidence >= 1.0)
        self.per_row_s = row_s
        if fit is None:
            return  # every step had the same shape: no slope identifiable yet
        a, b, c = fit
        if a > 0 and b > 0 and c > 0:
            self.fixed_s, self.per_seq_s, self.per_row_s = a, b, c
            if evidence >= 1.0:
                self._fitted_row_s = c

    def cost_per_token(self, num_seqs: int) -> float:
        """What one draft row costs, in plain tokens' worth of time, with `num_seqs` sequences."""
        s = max(1, num_seqs)
        return self.per_row_s * s / (self.fixed_s + self.per_seq_s * s)

    def seconds_per_token(self, num_seqs: int) -> float:
        """What one generated token costs in plain decoding with `num_seqs` sequences."""
        s = max(1, num_seqs)
        return (self.fixed_s + self.per_seq_s * s) / s
