"""The online speculation tuner: how long drafts may be, chosen from measured goodput.

The chain already prices every draft token with the step-cost fit and backs off failing
drafters, but its estimates are priors: on a workload where speculation does not pay it can
still lose a few percent to plain decoding (measured: mt_bench at concurrency 8, 0.89-0.96x).
The tuner closes that loop on what the user sees. Per concurrency bucket it runs a bandit over a
small grid of draft limits (`n_max`; 0 = no drafting at all, plain decoding; by default just 0
and the engine's own limit, i.e. whether to draft at all): each decode step uses one arm, and the
arm is scored by *goodput*, tokens committed per second of engine time (drafting, forward and
verification included), relative to what plain decoding would have taken for those tokens at
that step (the step-cost model's estimate, corrected by the measured plain steps; `ArmStats`),
smoothed so the choice follows a workload that changes. Requests that
set their own `n_max` are not tuned; `speculant tune` searches n_max and p_min offline.

Policy (the configured limit is the incumbent, as in ik_llama.cpp's speculative tuner, which
keeps the parameters with the best measured tokens/s; measured on the dev prompts, per-step
goodput is so bursty, a copy hit commits 10 tokens and the next step 1, that a plain argmax over
six arms chased noise and lost 5-15% to the untuned chain):
- the arms are first tried round-robin, `min_pulls` times each (interleaved, so the warm-up and
  any drift of the machine hit them alike), the incumbent being the engine's own `n_max`;
- then the incumbent is used, and another arm replaces it only when its goodput beats the
  incumbent's by `margin` *and* by `confidence` standard errors of the measured difference
  (`ArmStats.speedup_var`: drafting steps are bursty, four of them leave +-10%, and a plain
  margin switched a 1.5x chain off on translation at c=8). Hysteresis works both ways: plain
  decoding must clearly beat drafting to switch it off, drafting must clearly beat plain to
  switch it back on. Now and then another arm is measured again: every `explore_every` steps
  the most promising one while some arm might still beat the incumbent by the margin (too few
  steps to tell), else the one measured longest ago, at intervals that double (up to
  `max_explore_every`), so a settled choice costs under 1% in probes and a change in the
  workload still moves the choice.
  Where speculation does not pay, plain decoding wins within a few dozen steps and the engine
  then drafts nothing; where it pays, the untuned limit is kept unless another is clearly better.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# By default the tuner decides whether to draft at all: plain decoding (0) against the engine's
# own limit, which is always an arm. Finer grids (e.g. 0, 1, 2, 4, 8, 16) are a config away, but
# measured on the dev prompts they lost 5-15% to the untuned chain at concurrency 1: one step's
# goodput swings 1-17x with the text, and arms probed a step at a time never see the same text.
DEFAULT_GRID = (0,)
CONCURRENCY_BUCKETS = (1, 2, 4, 8, 16, 32)  # a bucket holds concurrencies up to its bound
# Plain decoding this much ahead of the incumbent after a single step each is trusted at once: a
# draft model's first steps (catching up on 8 prompts at c=8) cost ~10 plain steps each, and
# measuring it 4 times cost short benchmark runs up to 20%.
DECISIVE_GAP = 1.5
PRIOR_STEPS = 2.0  # pseudo-steps of the assumed per-step noise in an arm's variance


@dataclass(slots=True)
class ArmStats:
    """Measured goodput of one draft limit: exponentially weighted sums of the tokens and the
    seconds of the steps that used it (a ratio of sums: one slow step does not dominate), and of
    what plain decoding would have taken for the same tokens at the same step (`plain_seconds`:
    tokens x the step-cost model's plain seconds per token for that batch and context).

    Arms are compared by `speedup` = plain_seconds / seconds, each step measured against plain
    decoding at its own batch size and context: a step at context 2000 is slower than one at 200
    whichever arm takes it, so raw goodput compared arms measured at different points of the
    text (plain probed early in a prompt looked 10% faster than drafting later in it). The plain
    arm's own speedup is the model's error (measured / predicted plain steps), so the comparison
    stays honest where the model is biased.

    `speedup_var` is how uncertain that ratio is: the weighted spread of the steps around it
    (second moments kept beside the sums), divided by how many steps the weights amount to. A
    drafting step's speedup is bursty (measured on the chain at c=8: 0.79-1.25 from the 10th to
    the 90th percentile, a copy hit commits 10 tokens and the next step 1), so four steps each
    leave +-10%, more than the 5% margin: comparisons that ignored it switched a 1.5x chain off."""

    n_max: int
    pulls: int = 0
    last_pull: int = -1  # the bucket's step count when it was last used
    tokens: float = 0.0
    seconds: float = 0.0
    plain_seconds: float = 0.0
    weight: float = 0.0  # sum of the steps' weights (each step enters at 1, then decays)
    weight_sq: float = 0.0  # sum of their squares (the effective number of steps is w^2 / w2)
    plain_sq: float = 0.0  # weighted sums of plain_s^2, s^2 and plain_s * s per step
    seconds_sq: float = 0.0
    cross: float = 0.0

    @property
    def goodput(self) -> float:  # tokens / s, as measured (reported, not compared)
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def speedup(self) -> float:  # over plain decoding at the same steps (what arms are compared by)
        return self.plain_seconds / self.seconds if self.seconds > 0 else 0.0

    def speedup_var(self, prior_rel_sd: float) -> float:
        """Variance of `speedup`: a ratio of sums, so (delta method) the weighted mean square of
        the steps' residuals plain_s - speedup * s, times sum(w^2) / seconds^2. `PRIOR_STEPS`
        pseudo-steps of `prior_rel_sd` relative noise are added: one or two steps that happen to
        agree are not certainty."""
        if self.pulls == 0 or self.seconds <= 0:
            return math.inf
        r = self.speedup
        residual_sq = max(self.plain_sq - 2 * r * self.cross + r * r * self.seconds_sq, 0.0)
        mean_seconds = self.seconds / self.weight
        prior_sq = (prior_rel_sd * r * mean_seconds) ** 2
        residual_var = (residual_sq + PRIOR_STEPS * prior_sq) / (self.weight + PRIOR_STEPS)
        return residual_var * self.weight_sq / (self.seconds * self.seconds)

    def observe(self, tokens: int, seconds: float, plain_token_s: float, smoothing: float,
                step: int) -> None:
        keep = 1 - smoothing
        plain_s = tokens * plain_token_s
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.plain_seconds = keep * self.plain_seconds + plain_s
        self.weight = keep * self.weight + 1.0
        self.weight_sq = keep * keep * self.weight_sq + 1.0
        self.plain_sq = keep * self.plain_sq + plain_s * plain_s
        self.seconds_sq = keep * self.seconds_sq + seconds * seconds
        self.cross = keep * self.cross + plain_s * seconds
        self.pulls += 1
        self.last_pull = step


@dataclass(slots=True)
class BucketState:
    arms: list[ArmStats]
    explore_interval: int
    incumbent: int  # index of the arm used between re-measurements
    measuring: bool = True  # the first round-robin phase (skipped by a bucket that inherits)
    steps: int = 0
    current: int = 0  # index of the arm in use this step
    next_explore: int = 0  # the step at which an arm is re-measured next
    num_switches_off: int = 0  # times the incumbent moved to plain decoding (n_max 0)


def concurrency_bucket(num_decoding: int) -> int:
    """The smallest bucket bound >= num_decoding (the largest bound beyond the last)."""
    for bound in CONCURRENCY_BUCKETS:
        if num_decoding <= bound:
            return bound
    return CONCURRENCY_BUCKETS[-1]


@dataclass(slots=True)
class TunerConfig:
    """- grid: the draft limits tried besides the engine's own n_max (0 = plain decoding); those
      above the engine's n_max are dropped.
    - min_pulls: steps each limit is measured before the best is exploited.
    - explore_every, max_explore_every: the first and the longest interval between
      re-measurements of the limit measured longest ago.
    - smoothing: how fast an arm forgets old steps (weight decay per step it is used).
    - margin: how much more goodput than plain decoding a draft limit needs to be chosen.
    - confidence: how many standard errors of the measured difference an arm must also lead
      by to displace the incumbent (the choice is re-checked every step, hence well above 2).
    - prior_rel_sd: the per-step noise assumed before any spread is measured (`PRIOR_STEPS`
      pseudo-steps of it)."""

    grid: tuple[int, ...] = DEFAULT_GRID
    min_pulls: int = 4
    explore_every: int = 8
    max_explore_every: int = 1024
    smoothing: float = 0.02
    margin: float = 0.05
    confidence: float = 2.5
    prior_rel_sd: float = 0.3

    def __post_init__(self) -> None:
        self.grid = tuple(sorted(set(int(n) for n in self.grid)))
        if not self.grid or self.grid[0] < 0:
            raise ValueError(f"tuner grid must be draft limits >= 0, got {self.grid}")
        if self.min_pulls < 1 or not 2 <= self.explore_every <= self.max_explore_every:
            raise ValueError("tuner: min_pulls must be >= 1 and 2 <= explore_every <= "
                             "max_explore_every")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"tuner: smoothing must be in (0, 1], got {self.smoothing}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"tuner: margin must be in [0, 1), got {self.margin}")
        if self.confidence < 0.0 or self.prior_rel_sd < 0.0:
            raise ValueError("tuner: confidence and prior_rel_sd must be >= 0")


class SpecTuner:
    """One bandit per concurrency bucket; `choose` before a decode step, `observe` after it."""

    def __init__(self, config: TunerConfig, max_n: int):
        self.config = config
        self.grid = tuple(sorted({n for n in config.grid if n <= max_n} | {max_n}))
        self._buckets: dict[int, BucketState] = {}

    def choose(self, num_decoding: int) -> int:
        """The draft limit for a step with `num_decoding` decoding sequences."""
        state = self._bucket(num_decoding)
        arms = state.arms
        unmeasured = [i for i, a in enumerate(arms) if a.pulls < self.config.min_pulls]
        state.measuring = state.measuring and bool(unmeasured) and arms[state.incumbent].n_max != 0
        if state.measuring:
            # round-robin over the arms short of min_pulls, plain and the incumbent first: where
            # plain wins at once the other draft limits are not measured now (only re-measured,
            # one step at a time), which saves a draft model dozens of costly drafting steps
            first = {0, state.incumbent}
            index = min(unmeasured, key=lambda i: (i not in first, arms[i].pulls, i))
        elif state.steps >= state.next_explore:
            index = self._explore(state)
        else:
            index = state.incumbent
        state.current = index
        return arms[index].n_max

    def observe(self, num_decoding: int, tokens: int, seconds: float,
                plain_token_s: float) -> None:
        """The step that used the last chosen limit committed `tokens` in `seconds`; plain
        decoding would have taken `plain_token_s` per token for this batch (the step-cost
        model's estimate at this step)."""
        state = self._bucket(num_decoding)
        arm, incumbent = state.arms[state.current], state.arms[state.incumbent]
        arm.observe(tokens, seconds, plain_token_s, self.config.smoothing, state.steps)
        state.steps += 1
        if arm is not incumbent and not state.measuring:
            self._after_probe(state, arm, incumbent)
        self._challenge(state)

    def best(self, num_decoding: int) -> int:
        """The incumbent limit (the one used between re-measurements)."""
        state = self._bucket(num_decoding)
        return state.arms[state.incumbent].n_max

    def summary(self) -> dict:
        """Per concurrency bucket: the chosen limit, steps, switches to plain, goodput per arm."""
        return {str(bound): {
            "n_max": s.arms[s.incumbent].n_max, "steps": s.steps,
            "num_switches_off": s.num_switches_off,
            "goodput_tok_s": {str(a.n_max): round(a.goodput, 1) for a in s.arms if a.pulls},
            "speedup": {str(a.n_max): round(a.speedup, 3) for a in s.arms if a.pulls},
        } for bound, s in sorted(self._buckets.items())}

    def _bucket(self, num_decoding: int) -> BucketState:
        bound = concurrency_bucket(num_decoding)
        if bound not in self._buckets:
            self._buckets[bound] = self._new_bucket(bound)
        return self._buckets[bound]

    def _new_bucket(self, bound: int) -> BucketState:
        """The first bucket starts from the untuned setting (the engine's own, largest limit)
        and measures; later ones start from the nearest bucket's choice and only re-measure.
        (A batch filling up or draining passes through every smaller bucket for a few dozen
        steps: measuring plain in each of them cost the chain ~5% at c=8.) Goodput is not
        inherited: it scales with the number of sequences."""
        state = BucketState([ArmStats(n) for n in self.grid], incumbent=len(self.grid) - 1,
                            explore_interval=self.config.explore_every)
        if self._buckets:
            nearest = min(self._buckets, key=lambda b: abs(math.log2(b / bound)))
            state.incumbent, state.measuring = self._buckets[nearest].incumbent, False
            state.next_explore = self.config.explore_every
        return state

    def _challenge(self, state: BucketState) -> None:
        """The best-measured arm replaces the incumbent only when it beats it by the margin;
        a change brings re-measurement back to its shortest interval."""
        arms = state.arms
        measured = [i for i, a in enumerate(arms) if a.pulls >= self.config.min_pulls]
        plain, incumbent = arms[0], arms[state.incumbent]  # arm 0: the smallest limit
        if plain.pulls and incumbent.pulls and plain.speedup > DECISIVE_GAP * incumbent.speedup:
            measured = sorted(set(measured) | {0, state.incumbent})
        if 0 not in measured or state.incumbent not in measured:
            return
        best = max(measured, key=lambda i: arms[i].speedup)
        if not self._leads(arms[best], arms[state.incumbent]):
            return
        if arms[best].n_max == 0:
            state.num_switches_off += 1
        state.incumbent = best
        state.explore_interval = self.config.explore_every
        state.next_explore = state.steps + state.explore_interval

    def _leads(self, arm: ArmStats, incumbent: ArmStats) -> bool:
        """Whether `arm` beats the incumbent by the margin and by `confidence` standard errors
        of the difference (noise alone does not move the choice either way)."""
        gap = arm.speedup - incumbent.speedup
        return arm.speedup > (1 + self.config.margin) * incumbent.speedup and \
            gap > self.config.confidence * self._diff_sd(arm, incumbent)

    def _diff_sd(self, a: ArmStats, b: ArmStats) -> float:
        prior = self.config.prior_rel_sd
        return math.sqrt(a.speedup_var(prior) + b.speedup_var(prior))

    def _after_probe(self, state: BucketState, arm: ArmStats, incumbent: ArmStats) -> None:
        """A re-measured arm far behind the incumbent is probed half as often again: a probe of
        a losing draft model is costly (it catches up on every sequence's tokens since its last
        draft), as the shipped draft on chat at c=8."""
        if arm.speedup < (1 - 2 * self.config.margin) * incumbent.speedup:
            state.explore_interval = min(2 * state.explore_interval,
                                         self.config.max_explore_every)

    def _upper(self, arm: ArmStats, incumbent: ArmStats) -> float:
        """How fast `arm` might still be: its speedup plus `confidence` standard errors of its
        difference from the incumbent."""
        return arm.speedup + self.config.confidence * self._diff_sd(arm, incumbent)

    def _explore(self, state: BucketState) -> int:
        """The arm to re-measure. While some arm might still beat the incumbent by the margin
        (its upper bound reaches the switching line: too few steps to tell), the most promising
        such arm, every `explore_every` steps; once none can, the arm measured longest ago,
        twice as late each time (up to the longest interval), so a settled choice costs under
        1% in probes and still follows a workload that changes. (An inheriting bucket skips the
        measuring phase; its unmeasured arms count as open, so they are re-measured here, one
        step every `explore_every`, until they settle.)"""
        arms, incumbent = state.arms, state.arms[state.incumbent]
        others = [i for i in range(len(arms)) if i != state.incumbent] or [state.incumbent]
        line = (1 + self.config.margin) * incumbent.speedup
        upper = {i: self._upper(arms[i], incumbent) for i in others}
        open_arms = [i for i in others if upper[i] > line]
        if open_arms:
            state.explore_interval = self.config.explore_every
            state.next_explore = state.steps + state.explore_interval
            return max(open_arms, key=upper.get)
        index = min(others, key=lambda i: arms[i].last_pull)
        state.next_explore = state.steps + state.explore_interval
        state.explore_interval = min(2 * state.explore_interval, self.config.max_explore_every)
        return index
