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
  incumbent's by `margin` (hysteresis both ways: plain decoding must beat drafting by the margin
  to switch it off, drafting must beat plain by it to switch it back on); now and then the arm
  measured longest ago is measured again, so a change in the workload moves the choice. The
  interval starts at `explore_every` steps and doubles (up to `max_explore_every`) while the
  incumbent holds, so a settled choice costs under 1% in probes, and resets when it changes.
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
    stays honest where the model is biased."""

    n_max: int
    pulls: int = 0
    last_pull: int = -1  # the bucket's step count when it was last used
    tokens: float = 0.0
    seconds: float = 0.0
    plain_seconds: float = 0.0

    @property
    def goodput(self) -> float:  # tokens / s, as measured (reported, not compared)
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def speedup(self) -> float:  # over plain decoding at the same steps (what arms are compared by)
        return self.plain_seconds / self.seconds if self.seconds > 0 else 0.0

    def observe(self, tokens: int, seconds: float, plain_token_s: float, smoothing: float,
                step: int) -> None:
        keep = 1 - smoothing
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.plain_seconds = keep * self.plain_seconds + tokens * plain_token_s
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
    - margin: how much more goodput than plain decoding a draft limit needs to be chosen."""

    grid: tuple[int, ...] = DEFAULT_GRID
    min_pulls: int = 4
    explore_every: int = 8
    max_explore_every: int = 1024
    smoothing: float = 0.02
    margin: float = 0.05

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
        if arm is not incumbent and not state.measuring and \
                arm.speedup < (1 - 2 * self.config.margin) * incumbent.speedup:
            self._back_off(state)  # a re-measured arm that is far behind: probe it rarer
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
        if arms[best].speedup <= (1 + self.config.margin) * arms[state.incumbent].speedup:
            return
        if arms[best].n_max == 0:
            state.num_switches_off += 1
        state.incumbent = best
        state.explore_interval = self.config.explore_every
        state.next_explore = state.steps + state.explore_interval

    def _back_off(self, state: BucketState) -> None:
        """Double the re-measurement interval once more. A probe of a losing draft model is
        costly (it catches up on every sequence's tokens since its last draft), so where it
        lost by far, as the shipped draft on chat at c=8, it is measured half as often."""
        state.explore_interval = min(2 * state.explore_interval, self.config.max_explore_every)

    def _explore(self, state: BucketState) -> int:
        """The arm measured longest ago (not the incumbent); the next re-measurement comes
        twice as late, up to the longest interval. (An inheriting bucket thus measures slowly:
        at c=8 on long prompts most steps carry prefill chunks, and re-measuring plain every 8
        of the few decode-only steps cost the chain 10% there.)"""
        others = [i for i in range(len(state.arms)) if i != state.incumbent] or [state.incumbent]
        index = min(others, key=lambda i: state.arms[i].last_pull)
        state.next_explore = state.steps + state.explore_interval
        state.explore_interval = min(2 * state.explore_interval, self.config.max_explore_every)
        return index
