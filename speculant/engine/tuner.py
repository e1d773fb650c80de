"""The online speculation tuner: how long drafts may be, chosen from measured goodput.

The chain already prices every draft token with the step-cost fit and backs off failing
drafters, but its estimates are priors: on a workload where speculation does not pay it can
still lose a few percent to plain decoding (measured: mt_bench at concurrency 8, 0.89-0.96x).
The tuner closes that loop on what the user sees. Per concurrency bucket it runs a bandit over a
small grid of draft limits (`n_max`; 0 = no drafting at all, plain decoding): each decode step
uses one arm, and the arm is scored by *goodput*, tokens committed per second of engine time
(drafting, forward and verification included), smoothed so the choice follows a workload that
changes. Requests that set their own `n_max` are not tuned.

Policy (a greedy bandit with forced exploration, as in ik_llama.cpp's speculative tuner, which
keeps the parameters with the best measured tokens/s):
- the arms are first tried round-robin, `min_pulls` times each (interleaved, so the warm-up and
  any drift of the machine hit them alike);
- then the arm with the best goodput is used, where another arm must beat plain decoding by
  `margin` to be preferred to it (never slower than plain is the point); now and then the arm
  measured longest ago is measured again, so a change in the workload moves the choice. The
  interval starts at `explore_every` steps and doubles (up to `max_explore_every`) while
  re-measuring changes nothing, so a settled choice costs under 2% in probes; it resets when
  the best arm changes. Where speculation does not pay plain decoding wins within a few dozen steps, and the
  engine then drafts nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GRID = (0, 1, 2, 4, 8, 16)
CONCURRENCY_BUCKETS = (1, 2, 4, 8, 16, 32)  # a bucket holds concurrencies up to its bound


@dataclass(slots=True)
class ArmStats:
    """Measured goodput of one draft limit: exponentially weighted sums of the tokens and the
    seconds of the steps that used it (a ratio of sums: one slow step does not dominate)."""

    n_max: int
    pulls: int = 0
    last_pull: int = -1  # the bucket's step count when it was last used
    tokens: float = 0.0
    seconds: float = 0.0

    @property
    def goodput(self) -> float:  # tokens / s
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, tokens: int, seconds: float, smoothing: float, step: int) -> None:
        self.tokens = (1 - smoothing) * self.tokens + tokens
        self.seconds = (1 - smoothing) * self.seconds + seconds
        self.pulls += 1
        self.last_pull = step


@dataclass(slots=True)
class BucketState:
    arms: list[ArmStats]
    explore_interval: int
    steps: int = 0
    current: int = 0  # index of the arm in use
    next_explore: int = 0  # the step at which an arm is re-measured next
    best_before_explore: int | None = None  # best arm when the last re-measurement started
    num_switches_off: int = 0  # times the choice moved to plain decoding (n_max 0)


def concurrency_bucket(num_decoding: int) -> int:
    """The smallest bucket bound >= num_decoding (the largest bound beyond the last)."""
    for bound in CONCURRENCY_BUCKETS:
        if num_decoding <= bound:
            return bound
    return CONCURRENCY_BUCKETS[-1]


@dataclass(slots=True)
class TunerConfig:
    """- grid: the draft limits tried (0 = plain decoding); capped by the engine's n_max.
    - min_pulls: steps each limit is measured before the best is exploited.
    - explore_every, max_explore_every: the first and the longest interval between
      re-measurements of the limit measured longest ago.
    - smoothing: how fast an arm forgets old steps (weight decay per step it is used).
    - margin: how much more goodput than plain decoding a draft limit needs to be chosen."""

    grid: tuple[int, ...] = DEFAULT_GRID
    min_pulls: int = 4
    explore_every: int = 8
    max_explore_every: int = 64
    smoothing: float = 0.1
    margin: float = 0.03

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


class SpecTuner:
    """One bandit per concurrency bucket; `choose` before a decode step, `observe` after it."""

    def __init__(self, config: TunerConfig, max_n: int):
        self.config = config
        self.grid = tuple(n for n in config.grid if n <= max_n) or (0,)
        self._buckets: dict[int, BucketState] = {}

    def choose(self, num_decoding: int) -> int:
        """The draft limit for a step with `num_decoding` decoding sequences."""
        state = self._bucket(num_decoding)
        arms = state.arms
        measuring = any(a.pulls < self.config.min_pulls for a in arms)
        if measuring:  # round-robin over the arms still short of min_pulls
            index = min(range(len(arms)), key=lambda i: (arms[i].pulls, i))
        elif state.steps >= state.next_explore:
            index = self._explore(state)
        else:
            index = self._best_index(arms)
        if index != state.current and arms[index].n_max == 0 and not measuring:
            state.num_switches_off += 1
        state.current = index
        return arms[index].n_max

    def observe(self, num_decoding: int, tokens: int, seconds: float) -> None:
        """The step that used the last chosen limit committed `tokens` in `seconds`."""
        state = self._bucket(num_decoding)
        state.arms[state.current].observe(tokens, seconds, self.config.smoothing, state.steps)
        state.steps += 1

    def best(self, num_decoding: int) -> int:
        """The limit with the best measured goodput so far (the one exploited)."""
        arms = self._bucket(num_decoding).arms
        return arms[self._best_index(arms)].n_max

    def summary(self) -> dict:
        """Per concurrency bucket: the chosen limit, steps, switches to plain, goodput per arm."""
        return {str(bound): {
            "n_max": s.arms[self._best_index(s.arms)].n_max, "steps": s.steps,
            "num_switches_off": s.num_switches_off,
            "goodput_tok_s": {str(a.n_max): round(a.goodput, 1) for a in s.arms if a.pulls},
        } for bound, s in sorted(self._buckets.items())}

    def _bucket(self, num_decoding: int) -> BucketState:
        bound = concurrency_bucket(num_decoding)
        if bound not in self._buckets:
            self._buckets[bound] = BucketState([ArmStats(n) for n in self.grid],
                                               explore_interval=self.config.explore_every // 2)
        return self._buckets[bound]

    def _explore(self, state: BucketState) -> int:
        """The arm measured longest ago; the next re-measurement comes later (twice the
        interval) unless the last one changed the best arm."""
        best = self._best_index(state.arms)
        changed = state.best_before_explore is not None and best != state.best_before_explore
        state.explore_interval = self.config.explore_every if changed else \
            min(2 * state.explore_interval, self.config.max_explore_every)
        state.best_before_explore = best
        state.next_explore = state.steps + state.explore_interval
        return min(range(len(state.arms)), key=lambda i: state.arms[i].last_pull)

    def _best_index(self, arms: list[ArmStats]) -> int:
        """The arm with the best goodput; a draft limit must beat plain by the margin."""
        best = max(range(len(arms)), key=lambda i: arms[i].goodput)
        plain = next((i for i, a in enumerate(arms) if a.n_max == 0), None)
        if plain is not None and arms[best].goodput < (1 + self.config.margin) * arms[plain].goodput:
            return plain
        return best
