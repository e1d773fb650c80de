"""The online speculation tuner: how long drafts may be, chosen from measured goodput.

The chain already prices every draft token with the step-cost fit and backs off failing
drafters, but its estimates are priors: on a workload where speculation does not pay it can
still lose a few percent to plain decoding (measured: mt_bench at concurrency 8, 0.89-0.96x).
The tuner closes that loop on what the user sees. Per concurrency bucket it runs a bandit over a
small grid of draft limits (`n_max`; 0 = no drafting at all, plain decoding; by default just 0
and the engine's own limit, i.e. whether to draft at all): each decode step uses one arm, and the
arm is scored by *goodput*, tokens committed per second of engine time (drafting, forward and
verification included).

Arms are compared *in pairs, at the same moment*: a step of another arm (a probe) is scored
against the incumbent's goodput over its last few steps before it (`LOCAL_SMOOTHING`) and its
first `SETTLE_STEPS` after it, i.e. at the same context length, batch and machine state.
Goodput falls as contexts grow and this machine's speed drifts by 5-10% within minutes, so arms
measured at different times do not compare; an earlier version priced every step at the
step-cost model's plain estimate instead, and that model's bias (a linear fit of forward time in rows, dominated by drafting steps) read drafting
and plain equal on summarization at c=1 (0.914 vs 0.917) where drafting measured 0.92x plain,
which kept a losing draft model on.

Policy (the configured limit is the incumbent, as in ik_llama.cpp's speculative tuner, which
keeps the parameters with the best measured tokens/s; measured on the dev prompts, per-step
goodput is so bursty, a copy hit commits 10 tokens and the next step 1, that a plain argmax over
six arms chased noise and lost 5-15% to the untuned chain):
- after `warmup_steps` steps of the untuned limit (the chain calibrating its drafters), the
  arms are first measured `min_pulls` times each, every other step the incumbent (the
  engine's own `n_max`) so the reference stays fresh;
- then the incumbent is used, and another arm replaces it only when its goodput relative to the
  incumbent's exceeds 1 + `margin` by `confidence` standard errors (`ArmStats.speedup_var`:
  drafting steps are bursty, four of them leave +-10%, and a plain margin switched a 1.5x chain
  off on translation at c=8). Hysteresis works both ways: plain decoding must clearly beat
  drafting to switch it off, drafting must clearly beat plain to switch it back on. Now and then
  another arm is measured again: every `explore_every` steps the most promising one while some
  arm might still beat the incumbent by the margin (too few steps to tell), else the one
  measured longest ago, at intervals that double (up to `max_explore_every`), so a settled
  choice costs under 1% in probes and a change in the workload still moves the choice.
  Where speculation does not pay, plain decoding wins within a few dozen steps and the engine
  then drafts nothing; where it pays, the untuned limit is kept unless another is clearly better.
- plain decoding is not probed at all while the step-cost model puts a drafting incumbent far
  ahead of it (`TunerConfig.sure_lead`, see `SURE_LEAD_STEPS`): near parity the model's bias
  is what the paired probes are for, but no bias of its makes a 1.5x lead a loss, and each
  plain probe under a chain committing 4 tokens a step gives up most of a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# By default the tuner decides whether to draft at all: plain decoding (0) against the engine's
# own limit, which is always an arm. Finer grids (e.g. 0, 1, 2, 4, 8, 16) are a config away, but
# measured on the dev prompts they lost 5-15% to the untuned chain at concurrency 1: one step's
# goodput swings 1-17x with the text, and arms probed a step at a time never see the same text.
DEFAULT_GRID = (0,)
CONCURRENCY_BUCKETS = (1, 2, 4, 8, 16, 32)  # a bucket holds concurrencies up to its bound
# Plain decoding this much ahead of the incumbent (at any step) is trusted at once: a
# draft model's first steps (catching up on 8 prompts at c=8) cost ~10 plain steps each, and
# measuring it 4 times cost short benchmark runs up to 20%.
DECISIVE_GAP = 1.5
# ... over at least this many probes: one step is no evidence (on summarization at c=1 the
# draft's first step, reading the prompt and drafting its full n_max while still unpriced, took
# 17 ms against plain's 11 with its catch-up left out: switched off after one probe, the draft
# was never verified again in the run)
DECISIVE_PROBES = 2
PRIOR_STEPS = 2.0  # pseudo-steps of the assumed per-step noise in an arm's variance
# The incumbent's reference goodput forgets its older steps at this rate (about its last 8
# steps): recent enough that a probe meets the same context and machine state, long enough
# that one bursty drafting step does not set it.
LOCAL_SMOOTHING = 0.125
# When the incumbent's long-run goodput (`ArmStats.goodput`, its last ~50 steps) falls this far
# below what it was when another arm was compared with it, that comparison is stale (the text
# changed: a copy-heavy stretch ended, a prompt with nothing to copy began): it counts
# `STALE_WEIGHT` as much, so the arm is measured again soon (its uncertainty grows) and the
# choice follows the workload. Judged on its 8-step goodput instead, a few one-token steps after
# a copy hit read as a new text: on summarization at c=1 plain's record was discounted every
# ~100 steps and plain probed every 32 (76 plain steps in 2,236; replayed: 25).
STALE_DROP = 0.25
BEHIND_SLOWDOWN = 4  # an undecided arm measured behind the incumbent is probed this much rarer
# ... and one measured past the switching line, short only of confidence, this much more often:
# its probes cost nothing (it measures faster) and the decision comes sooner. Run H: plain at
# 1.06x the 4-layer draft on translation c=8, probed every 8 steps, was still undecided after
# the bucket's 181 steps.
AHEAD_SPEEDUP = 4
# Plain's smaller margin (TunerConfig.plain_margin) holds only while drafting gains less than
# this many accepted tokens per sequence per step (an accepted length under 1.1): a draft the
# chain mostly prices out can only cost its overhead, whereas drafting that wins in bursts (the
# chain on qa at c=8, 1.09x plain with an accepted length of 1.44) is judged by the full margin:
# with plain's, the tuner switched it off there (1.00x).
LOW_GAIN = 0.1
# ... averaged over the bucket's drafting steps (the last ~500 of them): the chain's gains come
# in bursts, and a 50-step average dipped under LOW_GAIN between them (qa at c=8: switched off)
GAIN_SMOOTHING = 0.002
# At concurrency 1 a new request restarts the bucket (`SpecTuner._restart`) unless the warm-ups
# of this many restarted requests in a row gained under LOW_GAIN (until drafting wins a
# comparison again). The long average above alone remembered the workload before: after 20
# summarization prompts where the 4-layer draft paid, it still read ~0.5 through the next 20 qa
# prompts, each of which restarted, drafted its 32 warm-up steps at a loss and was switched
# off again (13 switches off in one bench run; tuned 0.965x plain against 0.985x when qa ran
# alone). Two, not one: a request's drafting stretch that ended in a switch off is its worst;
# judged by its last 64 drafting steps, the draft switched off in summarization's first
# request never came back (1.03x plain where it pays 1.09x).
MAX_FAILED_WARMUPS = 2
# ... and past that (or while drafting has gained under LOW_GAIN) a request restarts the bucket
# only after 2, 4, 8, ... requests did not (`BucketState.num_backoffs`): never again starved a
# drafter switched off on a workload's first requests, the 4-layer draft on summarization at
# c=1 (1.086x plain untuned, 0.978x tuned: one switch off, then 4,524 plain steps and 13 drafts;
# AMD EPYC Zen 4, 2026-12-07 05:32 UTC, issue 18's command), while on a workload where drafting
# loses it costs ~3 warm-ups per 20 requests instead of 20.
# Drafting that gains nothing at all (fewer accepted tokens per sequence per step than this,
# over its last ~`NO_GAIN_STEPS` drafting steps, at least that many seen) commits exactly what
# plain decoding commits, at a cost: plain takes over at once, whatever the clock says. The
# chain prices a drafter like that out at nearly every step, so a drafting step cost only
# ~0.1-0.3 ms more than a plain one (c=8, 12 ms steps), 1-3% that the tuner's noisy paired
# comparison never resolved: the 4-layer draft at c=8 kept drafting on qa, 0.96x plain.
NO_GAIN = 0.02
NO_GAIN_STEPS = 32
STALE_WEIGHT = 0.25
# While plain decoding is the incumbent, one plain step in this many is a shadow round (the
# model-free speculators propose unverified, `SpeculatorChain.shadow`), and so is the step
# before each probe of drafting, so the probe meets speculators that followed the text. Every
# plain step a shadow round cost the chain ~0.6 ms of a 15 ms step at c=8 (2 threads, Xeon).
SHADOW_EVERY = 4
# Under a plain incumbent, a drafting arm that has gained tokens (`LOW_GAIN`) sees its
# comparison fade with the steps since it was last probed (weight exp(-steps / this)):
# drafting's worth changes with the text and with what the speculators have learned (the
# suffix tree grows over a run), plain's does not. Forgotten only per probe, the chain switched
# off at the 53rd step of a c=8 mt_bench run (where it measured 0.90x then) was probed 7 times
# in the next 300 steps at 0.90-1.19x and never came back, while the runs that kept it drafted
# 1.65x plain's tokens per step. Synthetic (tests/engine/test_tuner.py): drafting at 0.85x for
# 150 steps, then 1.4x, is back after 52 / 63 / 73 / 604 steps with horizons 64 / 128 / 256 /
# none, and drafting steadily at 0.9x is probed 111 / 44 / 21 / 2 times in 2,000 steps.
EVIDENCE_HORIZON = 256
# ... and a probe of such an arm that gains tokens and measures this much ahead of its record
# shows that the text turned: the old record then counts `STALE_WEIGHT` (`SpecTuner._turned`).
# The chain's probes in its turn on qa at c=8 read 1.25-1.30x plain against a record of 0.98.
TURN_LEAD = 1.2
# A probe is scored once the incumbent has taken this many steps after it: its reference is the
# incumbent's goodput over its last ~8 steps before the probe *and* these after it. Scored
# against the steps before alone, plain probes under the chain (`ngram_mod,suffix`, c=1) read
# 0.79 / 0.83 / 0.57 of the chain's goodput on summarization / qa / code_edit where plain's and
# the chain's own steps over the whole run gave 0.61 / 0.63 / 0.48: the chain's steps just
# before a probe committed 2.15-2.32 tokens (summarization), those just after 2.5-2.8. A probe
# often comes when the incumbent's goodput has just fallen (`STALE_DROP`: a request with less
# to copy began), i.e. in a dry spell that the steps after it leave. So the tuner saw a 1.7x
# chain as 1.2x, kept plain "open" and probed it every ~32 steps: 32-43 plain steps in
# 1,400-2,200, ~1% of the chain's speed. Replayed on the same logged runs, the steps before and
# after read 0.66 / 0.63 / 0.47.
SETTLE_STEPS = 8
# Under a plain incumbent, a probe of drafting makes the model drafters catch up on what the
# plain steps committed (each sequence's window, `chain.PROBE_CONTEXT_TOKENS`); the probe is not
# charged for it (`observe`), but it is paid all the same. So the next probe waits until that
# catch-up is this share of the plain steps since: the 4-layer draft's probes at c=8 on qa
# caught up 8 windows, 0.27-0.30 s (6.5-7.5 plain steps) each, two of them 3.7% of a 15 s run
# where it never paid (AMD EPYC Zen 1). Model-free speculators catch up on
# nothing: their probes keep their pace. The price is a slower return where the text turns:
# drafting at 0.5x, then 1.3x, with 2 plain steps of catch-up per probe, is back after 1,331
# steps at this share (638 without the wait; not within 3,000 at 0.01).
CATCH_UP_SHARE = 0.02
# The step-cost model's verdict on a drafting incumbent: over its last ~SURE_LEAD_STEPS steps,
# the time plain decoding would have taken for the tokens it committed (the model's plain step
# for that many sequences, per sequence's token) over the time it took. From SURE_LEAD_STEPS
# such steps on, a verdict of `TunerConfig.sure_lead` or more skips plain's probes. Measured
# before (issue 18's command, AMD EPYC Zen 4, 2026-12-07, three runs): on 13 code_edit prompts
# at c=8 the tuned chain ran 9 steps more than the untuned one, plain probes in the batch's
# tail (buckets 2 and 1, fresh there: the chain decides buckets 4 and 8 itself), where the
# chain commits ~4 tokens a sequence per step and the decode-only steps that the decode rate
# is measured on are mostly that tail: 0.950 / 0.976 / 0.992 of the untuned chain.
SURE_LEAD_STEPS = 16


@dataclass(slots=True)
class RecentRate:
    """Goodput of an arm's last few steps (exponentially weighted tokens and seconds)."""

    tokens: float = 0.0
    seconds: float = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        keep = 1 - LOCAL_SMOOTHING
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds

    @property
    def token_s(self) -> float | None:  # seconds per committed token, None before a token
        return self.seconds / self.tokens if self.tokens > 0 else None


@dataclass(slots=True)
class ArmStats:
    """Measured goodput of one draft limit, and (for an arm that is not the incumbent) how it
    compares with the incumbent at the same moments: exponentially weighted sums of each probe's
    seconds and of what the incumbent would have taken for the same tokens then (`ref_seconds`:
    tokens x the incumbent's recent seconds per token). `speedup` = ref_seconds / seconds is a
    ratio of sums, so one slow step does not dominate.

    `speedup_var` is how uncertain that ratio is: the weighted spread of the probes around it
    (second moments kept beside the sums), divided by how many probes the weights amount to. A
    drafting step's goodput is bursty (measured on the chain at c=8: 0.79-1.25 of plain from the
    10th to the 90th percentile, a copy hit commits 10 tokens and the next step 1), so four
    steps each leave +-10%, more than the 5% margin: comparisons that ignored it switched a
    1.5x chain off. The reference's own noise (a few bursty steps) is inside that spread."""

    n_max: int
    pulls: int = 0
    last_pull: int = -1  # the bucket's step count when it was last used
    tokens: float = 0.0  # goodput sums (reported, not compared)
    seconds: float = 0.0
    recent: RecentRate = field(default_factory=RecentRate)
    # paired sums against the incumbent's recent goodput (empty for the incumbent itself)
    probe_seconds: float = 0.0
    ref_seconds: float = 0.0
    last_ref_goodput: float = 0.0  # the incumbent's long-run goodput at the last probe
    weight: float = 0.0  # sum of the probes' weights (each enters at 1, then decays)
    weight_sq: float = 0.0  # sum of their squares (the effective number of probes is w^2 / w2)
    ref_sq: float = 0.0  # weighted sums of ref_s^2, s^2 and ref_s * s per probe
    seconds_sq: float = 0.0
    cross: float = 0.0

    @property
    def goodput(self) -> float:  # tokens / s, as measured
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def speedup(self) -> float:  # over the incumbent, at the same moments
        return self.ref_seconds / self.probe_seconds if self.probe_seconds > 0 else 0.0

    @property
    def compared(self) -> bool:
        return self.weight > 0

    def speedup_var(self, prior_rel_sd: float) -> float:
        """Variance of `speedup`: a ratio of sums, so (delta method) the weighted mean square of
        the probes' residuals ref_s - speedup * s, times sum(w^2) / seconds^2. `PRIOR_STEPS`
        pseudo-probes of `prior_rel_sd` relative noise are added: one or two probes that happen
        to agree are not certainty."""
        if not self.compared or self.probe_seconds <= 0:
            return math.inf
        r = self.speedup
        residual_sq = max(self.ref_sq - 2 * r * self.cross + r * r * self.seconds_sq, 0.0)
        mean_seconds = self.probe_seconds / self.weight
        prior_sq = (prior_rel_sd * r * mean_seconds) ** 2
        residual_var = (residual_sq + PRIOR_STEPS * prior_sq) / (self.weight + PRIOR_STEPS)
        return residual_var * self.weight_sq / (self.probe_seconds * self.probe_seconds)

    def observe(self, tokens: float, seconds: float, smoothing: float, step: int) -> None:
        keep = 1 - smoothing
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.recent.observe(tokens, seconds)
        self.pulls += 1
        self.last_pull = step

    def compare(self, tokens: float, seconds: float, ref_s: float, smoothing: float) -> None:
        """A probe that committed `tokens` in `seconds` where the incumbent would have taken
        `ref_s` (at its recent goodput, tokens / ref_s)."""
        keep = 1 - smoothing
        self.probe_seconds = keep * self.probe_seconds + seconds
        self.ref_seconds = keep * self.ref_seconds + ref_s
        self.weight = keep * self.weight + 1.0
        self.weight_sq = keep * keep * self.weight_sq + 1.0
        self.ref_sq = keep * self.ref_sq + ref_s * ref_s
        self.seconds_sq = keep * self.seconds_sq + seconds * seconds
        self.cross = keep * self.cross + ref_s * seconds

    def forget_comparison(self) -> None:
        self.discount(0.0)

    def discount(self, factor: float) -> None:
        """Older probes count `factor` as much (0: forgotten)."""
        self.probe_seconds *= factor
        self.ref_seconds *= factor
        self.weight *= factor
        self.weight_sq *= factor * factor
        self.ref_sq *= factor
        self.seconds_sq *= factor
        self.cross *= factor

    def mirror_of(self, other: "ArmStats") -> None:
        """This arm's comparison with `other`, from other's with this arm: the same probes,
        the two sides swapped (the ratio inverts, its weights stay)."""
        self.probe_seconds, self.ref_seconds = other.ref_seconds, other.probe_seconds
        self.last_ref_goodput = other.last_ref_goodput * other.speedup  # the new incumbent's
        self.weight, self.weight_sq = other.weight, other.weight_sq
        self.ref_sq, self.seconds_sq, self.cross = other.seconds_sq, other.ref_sq, other.cross

    def inherit(self, other: "ArmStats", factor: float) -> None:
        """`other`'s comparison (the same arm against the same incumbent, in a neighbouring
        bucket), its probes counting `factor` as much. Its reference goodput is not carried
        over: goodput scales with the number of sequences, the ratio roughly does not."""
        self.probe_seconds, self.ref_seconds = other.probe_seconds, other.ref_seconds
        self.weight, self.weight_sq = other.weight, other.weight_sq
        self.ref_sq, self.seconds_sq, self.cross = other.ref_sq, other.seconds_sq, other.cross
        self.discount(factor)

    def rescale_reference(self, factor: float) -> None:
        """The reference became `factor` times as slow per token (a new incumbent)."""
        self.ref_seconds *= factor
        self.ref_sq *= factor * factor
        self.cross *= factor


@dataclass(slots=True)
class BucketState:
    arms: list[ArmStats]
    explore_interval: int
    incumbent: int  # index of the arm used between re-measurements
    measuring: bool = True  # the first phase (skipped by a bucket that inherits)
    steps: int = 0
    current: int = 0  # index of the arm in use this step
    next_explore: int = 0  # the step at which an arm is re-measured next
    num_switches_off: int = 0  # times the incumbent moved to plain decoding (n_max 0)
    # accepted tokens per sequence per drafting step, a moving average (None before one)
    drafting_gain: float | None = None
    num_drafting_steps: int = 0
    # the gain summed over the drafting steps of this (re)start's warm-up, and their number
    warmup_gain: float = 0.0
    num_warmup_steps: int = 0
    # restarted requests in a row whose warm-up gained under LOW_GAIN (MAX_FAILED_WARMUPS)
    failed_warmups: int = 0
    # requests that did not restart the bucket since the last one that did, and how many
    # restarts came after such a wait (the next waits 2 ** (num_backoffs + 1) requests)
    requests_skipped: int = 0
    num_backoffs: int = 0
    # the same gain over the last ~NO_GAIN_STEPS drafting steps since the bucket (re)started
    recent_gain: float = 0.0
    num_recent_steps: int = 0
    start_step: int = 0  # `steps` when this bucket's measuring began (a restart: see `choose`)
    # steps from start_step that use the engine's own limit and compare nothing: a fresh
    # bucket's `TunerConfig.warmup_steps`, a restarted one's `restart_warmup_steps`
    warmup_steps: int = 0
    # under a plain incumbent, no probe of drafting before this step (`CATCH_UP_SHARE`)
    catch_up_until: int = 0
    step_s: float = 0.0  # the incumbent's seconds per step, its last ~8 steps
    # a drafting incumbent's last ~SURE_LEAD_STEPS steps: the model's plain seconds for the
    # tokens they committed, their measured seconds, and how many there were (since it became
    # the incumbent); plain probes skipped for its lead (`TunerConfig.sure_lead`)
    lead_plain_s: float = 0.0
    lead_seconds: float = 0.0
    num_lead_steps: int = 0
    num_probes_skipped: int = 0
    alone: int | None = None  # bucket 1: the sequence that decoded alone in its last step
    pending: list["PendingProbe"] = field(default_factory=list)  # probes not yet scored
    # bumped whenever what `_challenge` reads of the arms changes (a probe pulled or scored, a
    # comparison discounted, the incumbent switched); `challenged`: (version, whether drafting
    # gains nothing, whether it gains little) when `_challenge` last found no switch, so that
    # the incumbent's own steps, most steps, skip a check that cannot come out otherwise
    version: int = 0
    challenged: tuple[int, bool, bool] | None = None


@dataclass(slots=True)
class PendingProbe:
    """A probe waiting for the incumbent's steps after it (`SETTLE_STEPS`): what it committed
    and took, and the incumbent's recent tokens and seconds before it, then after it."""

    arm: int  # index into the bucket's arms
    step: int  # the bucket's step count at the probe
    tokens: float
    seconds: float
    gain: float  # accepted tokens per sequence in the probe's step
    ref_tokens: float
    ref_seconds: float
    num_after: int = 0

    @property
    def ref_token_s(self) -> float:  # the incumbent's seconds per token around the probe
        return self.ref_seconds / self.ref_tokens


def _bucket_bound(num_decoding: int) -> int:
    for bound in CONCURRENCY_BUCKETS:
        if num_decoding <= bound:
            return bound
    return CONCURRENCY_BUCKETS[-1]


# num_decoding -> its bucket, up to the largest bound: looked up several times a decode step
_BUCKET_OF = tuple(_bucket_bound(n) for n in range(CONCURRENCY_BUCKETS[-1] + 1))


def concurrency_bucket(num_decoding: int) -> int:
    """The smallest bucket bound >= num_decoding (the largest bound beyond the last)."""
    if num_decoding < len(_BUCKET_OF):
        return _BUCKET_OF[max(num_decoding, 0)]
    return CONCURRENCY_BUCKETS[-1]


@dataclass(slots=True)
class TunerConfig:
    """- grid: the draft limits tried besides the engine's own n_max (0 = plain decoding); those
      above the engine's n_max are dropped.
    - warmup_steps: steps of a fresh tuner's first bucket that use the engine's own limit
      before any other is measured: the chain's own learning time (a model drafter is priced
      only after `calibration.MIN_FIRST` first tokens; before that it drafts its full n_max).
      Compared during those steps, the 4-layer draft's first long failed drafts measured 1.5x
      slower than plain on summarization at c=1 and drafting was switched off for 73% of the
      run where it paid 1.035x.
    - min_pulls: steps each limit is measured before the best is exploited.
    - explore_every, max_explore_every: the first and the longest interval between
      re-measurements of the limit measured longest ago.
    - smoothing: how fast an arm forgets old steps (weight decay per step it is used).
    - margin: how much more goodput than the incumbent another limit needs to replace it.
    - plain_margin: the same for plain decoding (limit 0) replacing a drafting incumbent whose
      drafts gain little (`LOW_GAIN`): smaller, because switching to plain then costs nothing
      even when drafting was as fast; staying with a draft 3-5% behind is a loss the margin
      alone would keep forever (run H: the 4-layer draft at c=8 measured 0.94x by the tuner
      over 181 steps on translation, never switched off).
    - confidence: how many standard errors of its measured ratio an arm must also lead
      by to displace the incumbent (the choice is re-checked every step, hence well above 2).
    - prior_rel_sd: the per-step noise assumed before any spread is measured (`PRIOR_STEPS`
      pseudo-steps of it).
    - sure_lead: the goodput over plain decoding, as the step-cost model reads a drafting
      incumbent's recent steps (`SURE_LEAD_STEPS`), from which plain is not probed at all
      (0: always probed)."""

    grid: tuple[int, ...] = DEFAULT_GRID
    warmup_steps: int = 32
    restart_warmup_steps: int = 12
    min_pulls: int = 4
    explore_every: int = 8
    max_explore_every: int = 1024
    smoothing: float = 0.02
    margin: float = 0.05
    plain_margin: float = 0.02
    confidence: float = 2.5
    prior_rel_sd: float = 0.3
    sure_lead: float = 1.5

    def __post_init__(self) -> None:
        self.grid = tuple(sorted(set(int(n) for n in self.grid)))
        if not self.grid or self.grid[0] < 0:
            raise ValueError(f"tuner grid must be draft limits >= 0, got {self.grid}")
        if self.warmup_steps < 0 or self.restart_warmup_steps < 0:
            raise ValueError(f"tuner: warmup_steps and restart_warmup_steps must be >= 0, got "
                             f"{self.warmup_steps}, {self.restart_warmup_steps}")
        if self.min_pulls < 1 or not 2 <= self.explore_every <= self.max_explore_every:
            raise ValueError("tuner: min_pulls must be >= 1 and 2 <= explore_every <= "
                             "max_explore_every")
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"tuner: smoothing must be in (0, 1], got {self.smoothing}")
        if not (0.0 <= self.margin < 1.0 and 0.0 <= self.plain_margin < 1.0):
            raise ValueError(f"tuner: margin and plain_margin must be in [0, 1), got "
                             f"{self.margin}, {self.plain_margin}")
        if self.confidence < 0.0 or self.prior_rel_sd < 0.0:
            raise ValueError("tuner: confidence and prior_rel_sd must be >= 0")
        if self.sure_lead != 0.0 and self.sure_lead <= 1.0:
            raise ValueError(f"tuner: sure_lead must be > 1 (or 0: off), got {self.sure_lead}")


class SpecTuner:
    """One bandit per concurrency bucket; `choose` before a decode step, `observe` after it."""

    def __init__(self, config: TunerConfig, max_n: int):
        self.config = config
        self.grid = tuple(sorted({n for n in config.grid if n <= max_n} | {max_n}))
        self._buckets: dict[int, BucketState] = {}
        # per concurrency bucket: decode steps whose drafting the chain decided itself
        # (`leave_to_chain`)
        self._left_to_chain: dict[int, int] = {}

    def choose(self, num_decoding: int, alone: int | None = None) -> int:
        """The draft limit for a step with `num_decoding` decoding sequences. `alone`: the id of
        the only decoding sequence (None when several decode). At concurrency 1 the choice is
        made per request: when another sequence decodes alone than in the bucket's last step
        while plain decoding is the incumbent, the bucket starts over (see `_restart`), since
        one request's text says little about the next one's. Carried from request to request,
        one decision lost to the untuned limit on the dev prompts at c=1: the draft switched
        off on summarization's first prompt stayed off for 19 prompts where it paid 1.035x
        plain, and the chain switched off by a dry spell on qa fell from 1.41x to 1.34x."""
        state = self._bucket(num_decoding)
        if num_decoding == 1 and alone is not None:
            if state.alone is not None and state.alone != alone:
                state = self._restart(state)
            state.alone = alone
        arms = state.arms
        if state.measuring:  # once over, the measuring phase stays over (a restart is a new state)
            sure = self._sure_lead(state)
            unmeasured = [i for i, a in enumerate(arms)
                          if i != state.incumbent and a.pulls < self.config.min_pulls
                          and not (sure and a.n_max == 0)]
            state.measuring = bool(unmeasured) and arms[state.incumbent].n_max != 0
        if state.measuring and state.steps - state.start_step < state.warmup_steps:
            index = state.incumbent  # the chain learns first (TunerConfig.warmup_steps)
        elif state.measuring:
            # every other step the incumbent, so that each probe meets a fresh reference; plain
            # first among the others: where it wins at once the other draft limits are not
            # measured now (only re-measured, one step at a time), which saves a draft model
            # dozens of costly drafting steps
            if state.current != state.incumbent or arms[state.incumbent].pulls == 0:
                index = state.incumbent
            else:
                index = min(unmeasured, key=lambda i: (arms[i].n_max != 0, arms[i].pulls, i))
        elif state.steps >= _next_probe(state) and self._settle(state):
            index = self._explore(state)
            self._fade(state, state.arms[index])
        else:
            index = state.incumbent
        state.current = index
        return arms[index].n_max

    def observe(self, num_decoding: int, tokens: int, seconds: float,
                catch_up_seconds: float = 0.0, plain_step_s: float = 0.0) -> None:
        """The step that used the last chosen limit committed `tokens` in `seconds`, of which
        `catch_up_seconds` went to drafters reading tokens committed while they were not asked;
        `plain_step_s`: what the step-cost model says a plain step of `num_decoding` sequences
        takes now (0: no estimate), which a drafting incumbent's lead is read from.
        A probe is not charged for that: the arm, if chosen, would pay it once, not per step
        (measured on summarization at c=1: a draft-model probe after 127 plain steps took 29 ms,
        15 of them drafting, where the probes around it took 10-12 ms; one such outlier's
        spread keeps the comparison open for dozens of probes). The incumbent is: its catch-up
        is mostly the windows its shadow drafts re-read, a cost it pays again and again (the
        4-layer draft on qa at c=1, verified almost never: 0.95x plain in the bench, 0.986x in
        the tuner's eyes when that was left out, and never switched off). The steps that read a
        new request's prompt fall in the warm-up of a fresh or restarted bucket
        (`TunerConfig.warmup_steps`, `restart_warmup_steps`), which is not charged for it
        either; after a warm-up, with drafting the incumbent, a later request's read fades from
        its recent goodput within ~8 steps, and plain needs two decisive probes."""
        state = self._bucket(num_decoding)
        arm, incumbent = state.arms[state.current], state.arms[state.incumbent]
        scored: list[tuple[ArmStats, int]] = []
        warming = state.measuring and state.steps - state.start_step < state.warmup_steps
        if warming:
            # a new request's prompt, read once by the drafters at its first step, is not what
            # the arm costs a step: a restart's 12-step warm-up still carried a fifth of it
            # into the reference its first probes met
            seconds = max(seconds - catch_up_seconds, 0.1 * seconds)
        if arm is not incumbent:
            state.version += 1  # its pulls count in `_challenge`
            self._wait_after_catch_up(state, catch_up_seconds)
            seconds = max(seconds - catch_up_seconds, 0.1 * seconds)
            if incumbent.recent.tokens > 0:
                probe = PendingProbe(state.current, state.steps, tokens, seconds,
                                     tokens / num_decoding - 1.0,
                                     incumbent.recent.tokens, incumbent.recent.seconds)
                state.pending.append(probe)
                if self._decisive(state, probe):
                    scored = self._score_pending(state, only=probe)
        else:
            state.step_s = seconds if not state.step_s else \
                (1 - LOCAL_SMOOTHING) * state.step_s + LOCAL_SMOOTHING * seconds
            if arm.n_max > 0 and plain_step_s > 0 and seconds > 0:
                keep = 1 - 1 / SURE_LEAD_STEPS
                state.lead_plain_s = keep * state.lead_plain_s + tokens * plain_step_s / num_decoding
                state.lead_seconds = keep * state.lead_seconds + seconds
                state.num_lead_steps += 1
            if state.pending:
                for probe in state.pending:
                    probe.ref_tokens += tokens
                    probe.ref_seconds += seconds
                    probe.num_after += 1
                scored = self._score_pending(state, min_after=SETTLE_STEPS)
        arm.observe(tokens, seconds, self.config.smoothing, state.steps)
        if arm.n_max > 0:
            state.num_drafting_steps += 1
            gain = tokens / num_decoding - 1.0
            if warming:
                state.warmup_gain += gain
                state.num_warmup_steps += 1
            weight = max(1.0 / state.num_drafting_steps, GAIN_SMOOTHING)
            state.drafting_gain = gain if state.drafting_gain is None else \
                state.drafting_gain + weight * (gain - state.drafting_gain)
            state.num_recent_steps += 1
            recent = max(1.0 / state.num_recent_steps, 1.0 / NO_GAIN_STEPS)
            state.recent_gain += recent * (gain - state.recent_gain)
        state.steps += 1
        if not state.measuring:
            if arm is incumbent:
                self._discount_stale(state)
            for probed, step in scored:
                self._after_probe(state, probed, step)
        self._challenge(state)

    def _wait_after_catch_up(self, state: BucketState, catch_up_seconds: float) -> None:
        """A probe under a plain incumbent spent `catch_up_seconds` on drafters catching up:
        the next probe waits until that is `CATCH_UP_SHARE` of the plain steps since."""
        if catch_up_seconds <= 0 or state.arms[state.incumbent].n_max != 0 or not state.step_s:
            return
        plain_steps = catch_up_seconds / state.step_s
        state.catch_up_until = max(state.catch_up_until,
                                   state.steps + math.ceil(plain_steps / CATCH_UP_SHARE))

    def _settle(self, state: BucketState) -> bool:
        """A probe is due: score the pending ones with the incumbent's steps seen after them so
        far (the next probe is chosen on what the last one showed, as if that one had been
        scored at once). Whether a probe is still due after that (scoring may have moved the
        schedule, `_after_probe`, or the incumbent, `_challenge`)."""
        for probed, step in self._score_pending(state):
            if not state.measuring:
                self._after_probe(state, probed, step)
        self._challenge(state)
        return state.steps >= state.next_explore

    def _decisive(self, state: BucketState, probe: PendingProbe) -> bool:
        """Whether a probe of plain decoding is so far ahead of a drafting incumbent
        (`DECISIVE_GAP`, against its steps before the probe) that it is scored at once: a
        draft model catching up on its prompts costs ~10 plain steps a step, and waiting
        `SETTLE_STEPS` of them for a precise reference costs more than it can tell."""
        ratio = probe.tokens * probe.ref_token_s / probe.seconds
        return state.arms[probe.arm].n_max == 0 and ratio > DECISIVE_GAP

    def _score_pending(self, state: BucketState, min_after: int = 0,
                       only: PendingProbe | None = None) -> list[tuple[ArmStats, int]]:
        """Score the pending probes that have seen `min_after` incumbent steps after them (or
        just `only`) against the incumbent's goodput around them; returns their arms and
        steps."""
        due = [p for p in state.pending if p is only or (only is None and p.num_after >= min_after)]
        if not due:
            return []
        incumbent = state.arms[state.incumbent]
        state.version += 1
        state.pending = [p for p in state.pending if all(p is not d for d in due)]
        for probe in due:
            arm = state.arms[probe.arm]
            ref_s = probe.tokens * probe.ref_token_s
            if self._turned(state, arm, probe.gain, ref_s / probe.seconds):
                arm.discount(STALE_WEIGHT)
            arm.compare(probe.tokens, probe.seconds, ref_s, self.config.smoothing)
            arm.last_ref_goodput = incumbent.goodput
        return [(state.arms[p.arm], p.step) for p in due]

    def best(self, num_decoding: int) -> int:
        """The incumbent limit (the one used between re-measurements); for a bucket that has
        not decoded yet, the one it would start from (it is not created: see `_new_bucket`)."""
        bound = concurrency_bucket(num_decoding)
        state = self._buckets.get(bound) or self._new_bucket(bound)
        return state.arms[state.incumbent].n_max

    def shadow_due(self, num_decoding: int) -> bool:
        """Whether this plain step of `num_decoding` sequences should be a shadow round: plain
        decoding is the bucket's incumbent, and the step is one in `SHADOW_EVERY` or the next
        one probes drafting (`next_explore`). A bucket that has not decoded yet: no."""
        state = self._buckets.get(concurrency_bucket(num_decoding))
        if state is None or state.arms[state.incumbent].n_max != 0:
            return False
        return state.steps % SHADOW_EVERY == 0 or state.steps + 1 >= _next_probe(state)

    def leave_to_chain(self, num_decoding: int) -> None:
        """A decode step of `num_decoding` sequences whose drafting the chain decides itself,
        so the tuner neither chooses nor scores it: counted per bucket (`summary`). That is
        where every speculator asked is a model drafter the chain's ledger rests through the
        step, or model-free with their ledger account booking the concurrency
        (`SpeculatorChain.decides_drafting`; speculators/model_free_rest.py). The model-free
        account rests them where their drafts lose, still drafting every 8th round and
        following copies per sequence, while the tuner's plain arm kept them following the
        text and shadow-drafting, and bet on noisy paired steps: on 20 mt_bench prompts at
        c=8 (Intel Xeon with AMX, 2 threads, in-process interleaved, 2 repeats)
        `ngram_mod,suffix` read 0.998x plain untuned and 0.964x tuned, the tuner having
        switched to plain."""
        bound = concurrency_bucket(num_decoding)
        self._left_to_chain[bound] = self._left_to_chain.get(bound, 0) + 1

    def summary(self) -> dict:
        """Per concurrency bucket: the chosen limit, steps, switches to plain, goodput per arm
        and each arm's speedup over plain decoding measured at the same moments, the decode
        steps left to the chain (`leave_to_chain`; a bucket the tuner never chose for shows the
        engine's limit), and the probes of plain skipped for a sure lead (`sure_lead`)."""
        out = {}
        for bound in sorted(self._buckets.keys() | self._left_to_chain.keys()):
            s = self._buckets.get(bound)
            out[str(bound)] = {
                "n_max": self.grid[-1] if s is None else s.arms[s.incumbent].n_max,
                "steps": 0 if s is None else s.steps,
                "num_switches_off": 0 if s is None else s.num_switches_off,
                "goodput_tok_s": {} if s is None else
                {str(a.n_max): round(a.goodput, 1) for a in s.arms if a.pulls},
                "speedup": {} if s is None else _speedups_over_plain(s),
                "steps_left_to_chain": self._left_to_chain.get(bound, 0),
                "plain_probes_skipped": 0 if s is None else s.num_probes_skipped,
            }
        return out

    def _bucket(self, num_decoding: int) -> BucketState:
        bound = concurrency_bucket(num_decoding)
        if bound not in self._buckets:
            self._buckets[bound] = self._new_bucket(bound)
        return self._buckets[bound]

    def _new_bucket(self, bound: int) -> BucketState:
        """The first bucket that decodes starts from the untuned setting (the engine's own,
        largest limit), warms up and measures; later ones start from the nearest such
        bucket's choice and only re-measure. (A batch filling up or draining passes through
        every smaller bucket for a few dozen steps: measuring plain in each of them cost the
        chain ~5% at c=8.) Goodput is not inherited: it scales with the number of sequences.
        Only buckets that decoded pass their choice on: bucket 8 once inherited from a bucket
        2 that had only served steps with prompt chunks at the start of a c=8 run, so it
        skipped its warm-up, probed plain at its 9th step and switched the chain off at its
        45th, before the chain had learned the text (mt_bench, one run in three)."""
        state = BucketState([ArmStats(n) for n in self.grid], incumbent=len(self.grid) - 1,
                            explore_interval=self.config.explore_every,
                            warmup_steps=self.config.warmup_steps)
        stepped = [b for b, s in self._buckets.items() if s.steps > 0]
        if stepped:
            nearest_bound = min(stepped, key=lambda b: abs(math.log2(b / bound)))
            nearest = self._buckets[nearest_bound]
            state.incumbent, state.measuring = nearest.incumbent, False
            for arm, known in zip(state.arms, nearest.arms):
                if known.compared:
                    arm.inherit(known, STALE_WEIGHT)
            if nearest_bound > bound:
                # a drafting lead read with more sequences holds with fewer (a verified row
                # costs a smaller share of a step there): the batch's tail starts from it
                state.lead_plain_s, state.lead_seconds = nearest.lead_plain_s, nearest.lead_seconds
                state.num_lead_steps = nearest.num_lead_steps
            others = [a for i, a in enumerate(state.arms) if i != state.incumbent]
            behind = all(a.compared and a.speedup < 1.0 for a in others)
            state.next_explore = self.config.explore_every * (BEHIND_SLOWDOWN if behind else 1)
        return state

    def _restart(self, old: BucketState) -> BucketState:
        """Bucket 1 for a new request, when plain decoding is its incumbent: the untuned limit
        again, warm-up and measuring as for a fresh tuner (the chain then learns the new text
        before anything is compared); the step count, the switches off and drafting's gain
        carry on. Kept as it is while drafting is the incumbent (4 plain probes per request
        would cost a 1.9x chain ~1.5% of a 130-step request, by arithmetic; the usual probes
        follow the new text), and while drafting has gained nothing so far (`LOW_GAIN`, over
        every request's drafting steps): a drafter the chain prices out everywhere has no good
        request to find, and its small cost, within one request's noise, is only told from
        plain over many requests; nor after MAX_FAILED_WARMUPS restarted requests in a row
        whose warm-up gained little (the requests it paid on are over; a comparison it wins
        under plain brings the restarts back, `_switch`). In those two cases a request still
        restarts after 2, 4, 8, ... requests that did not (`num_backoffs`): a drafter that
        lost on a workload's first requests is not starved of evidence for the rest of it."""
        if old.num_warmup_steps:  # the last warm-up, counted once
            failed = old.warmup_gain / old.num_warmup_steps < LOW_GAIN
            old.failed_warmups = old.failed_warmups + 1 if failed else 0
            old.warmup_gain, old.num_warmup_steps = 0.0, 0
        if old.arms[old.incumbent].n_max != 0 or old.drafting_gain is None:
            return old
        if old.drafting_gain < LOW_GAIN or old.failed_warmups >= MAX_FAILED_WARMUPS:
            old.requests_skipped += 1
            if old.requests_skipped <= 2 ** (old.num_backoffs + 1):
                return old
            old.num_backoffs += 1  # waited long enough: this request restarts
        state = BucketState([ArmStats(n) for n in self.grid], incumbent=len(self.grid) - 1,
                            explore_interval=self.config.explore_every, steps=old.steps,
                            start_step=old.steps, warmup_steps=self.config.restart_warmup_steps,
                            num_switches_off=old.num_switches_off,
                            drafting_gain=old.drafting_gain, failed_warmups=old.failed_warmups,
                            num_drafting_steps=old.num_drafting_steps,
                            num_backoffs=old.num_backoffs)
        self._buckets[concurrency_bucket(1)] = state
        return state

    def _challenge(self, state: BucketState) -> None:
        """The best-measured arm replaces the incumbent only when it leads it clearly (`_leads`);
        a change brings re-measurement back to its shortest interval."""
        arms, min_pulls = state.arms, self.config.min_pulls
        gains_nothing = _gains_nothing(state)
        low_gain = state.drafting_gain is not None and state.drafting_gain < LOW_GAIN
        if state.challenged == (state.version, gains_nothing, low_gain):
            return  # nothing it reads changed since it last found no switch
        # drafting that gains nothing does not take over, whatever its record says: plain took
        # over for that reason, and a drafting arm let back at once by its clock record flapped
        # every other step (c=8 mt_bench: switched off 32 times in 374 steps, 0.97x plain)
        candidates = [i for i, a in enumerate(arms)
                      if i != state.incumbent and a.compared and a.pulls >= min_pulls
                      and not (a.n_max > 0 and gains_nothing)]
        plain = arms[0]  # arm 0: the smallest limit
        if gains_nothing and state.incumbent != 0:
            self._score_pending(state)  # the clock does not matter here: no need to wait
        if state.incumbent != 0 and plain.compared and (gains_nothing or (
                plain.pulls >= DECISIVE_PROBES and plain.speedup > DECISIVE_GAP)):
            self._switch(state, 0)
            if gains_nothing:
                # its record was made while it gained tokens: it comes back on fresh probes
                # that gain again and lead (`_leads`), not on one probe that lifts the gain
                for arm in arms[1:]:
                    arm.forget_comparison()
            return
        if candidates:
            best = max(candidates, key=lambda i: arms[i].speedup)
            if self._leads(arms[best], state):
                self._switch(state, best)
                return
        state.challenged = (state.version, gains_nothing, low_gain)

    def _switch(self, state: BucketState, index: int) -> None:
        """`index` becomes the incumbent: the other arms' comparisons are re-expressed against
        it (the old incumbent's is the mirror of the new one's)."""
        self._score_pending(state)  # against the old incumbent, with the steps seen so far
        arms, old = state.arms, state.arms[state.incumbent]
        new = arms[index]
        for arm in arms:
            if arm is not new and arm is not old:
                arm.rescale_reference(1.0 / new.speedup)
                arm.last_ref_goodput *= new.speedup
        old.mirror_of(new)
        new.forget_comparison()
        state.incumbent = index
        state.version += 1
        state.lead_plain_s = state.lead_seconds = 0.0  # read anew for the new incumbent
        state.num_lead_steps = 0
        if new.n_max == 0:
            state.num_switches_off += 1
        else:
            # drafting won again: new requests restart again
            state.failed_warmups = state.num_backoffs = 0
        state.explore_interval = self.config.explore_every
        state.next_explore = state.steps + state.explore_interval

    def _sure_lead(self, state: BucketState) -> bool:
        """Whether the step-cost model reads the drafting incumbent's recent steps at
        `sure_lead` times plain decoding's goodput or more (`SURE_LEAD_STEPS` of them seen)."""
        return self.config.sure_lead > 0 and state.arms[state.incumbent].n_max > 0 \
            and state.num_lead_steps >= SURE_LEAD_STEPS \
            and state.lead_plain_s >= self.config.sure_lead * state.lead_seconds

    def _leads(self, arm: ArmStats, state: BucketState) -> bool:
        """Whether `arm` beats the incumbent by the margin and by `confidence` standard errors
        of its measured ratio (noise alone does not move the choice either way)."""
        r = arm.speedup
        return r > 1 + self._margin(arm, state) and r - 1 > self.config.confidence * self._sd(arm)

    def _margin(self, arm: ArmStats, state: BucketState) -> float:
        """The lead `arm` needs over the incumbent: plain's smaller one while drafting gains
        little (`LOW_GAIN`), the full margin otherwise."""
        low_gain = state.drafting_gain is not None and state.drafting_gain < LOW_GAIN
        return self.config.plain_margin if arm.n_max == 0 and low_gain else self.config.margin

    def _sd(self, arm: ArmStats) -> float:
        return math.sqrt(arm.speedup_var(self.config.prior_rel_sd))

    def _discount_stale(self, state: BucketState) -> None:
        """Comparisons made when the incumbent was much faster than now count less, and those
        arms are due for re-measurement (see `STALE_DROP`)."""
        goodput = state.arms[state.incumbent].goodput
        if not goodput:
            return
        for i, arm in enumerate(state.arms):
            if i != state.incumbent and arm.compared and \
                    goodput < (1 - STALE_DROP) * arm.last_ref_goodput:
                arm.discount(STALE_WEIGHT)
                arm.last_ref_goodput = goodput
                state.version += 1
                state.explore_interval = self.config.explore_every
                state.next_explore = min(state.next_explore, state.steps)

    def _after_probe(self, state: BucketState, arm: ArmStats, step: int) -> None:
        """A re-measured arm far behind the incumbent is probed half as often again: a probe of
        a losing draft model is costly (it catches up on every sequence's tokens since its last
        draft), as the shipped draft on chat at c=8. One that may now beat the incumbent is
        measured again soon: at the base interval while it measures ahead, `BEHIND_SLOWDOWN`
        times that while it measures behind (as `_explore` schedules it). `step`: the probe's
        own step (it is scored up to `SETTLE_STEPS` later): the intervals count from it."""
        if arm.compared and arm.speedup < 1 - 2 * self.config.margin:
            state.explore_interval = min(2 * state.explore_interval,
                                         self.config.max_explore_every)
        if not self._open(arm, state, self._upper(arm)):
            return
        base = self.config.explore_every
        if arm.compared and arm.speedup < 1.0:
            # not sooner than that: the first probe of an arm not compared yet was scheduled at
            # the base interval, and kept there, plain was probed every 8 steps under a 1.4x
            # chain (5 plain steps in the 82 decode-only steps of code_edit at c=8)
            state.next_explore = max(state.next_explore, step + 1 + base * BEHIND_SLOWDOWN)
        else:
            # measured again at the base interval, not at the doubled one its pick set (a chain
            # probed at step 189 at 1.17x plain, upper bound 1.66, had its next probe set for
            # step 701)
            state.explore_interval = base
            state.next_explore = min(state.next_explore, step + 1 + base)

    def _turned(self, state: BucketState, arm: ArmStats, gain: float, ratio: float) -> bool:
        """Whether a probe of drafting under a plain incumbent shows that the text turned: it
        gained tokens (`LOW_GAIN` per sequence) and measured far ahead of the arm's record
        (`TURN_LEAD`). Its old comparison then counts `STALE_WEIGHT` as much, the mirror of
        `_discount_stale`. Without it, the chain switched off in its first 60 steps of a c=8
        qa run (gain 0.07, 0.93x plain then) carried 14 probes' worth of that record, and its
        later probes committing 2-3x plain's tokens at 1.25-1.30x plain's goodput moved it
        0.03 each: off for 150 steps, 1.03x plain against 1.10x untuned."""
        return arm.n_max > 0 and state.arms[state.incumbent].n_max == 0 and arm.compared \
            and gain >= LOW_GAIN and ratio > TURN_LEAD * arm.speedup

    def _fade(self, state: BucketState, arm: ArmStats) -> None:
        """Before a drafting arm is probed under a plain incumbent, its old comparison counts
        less the longer ago it was made (`EVIDENCE_HORIZON`)."""
        if arm.n_max > 0 and state.arms[state.incumbent].n_max == 0 and arm.last_pull >= 0 \
                and state.drafting_gain is not None and state.drafting_gain >= LOW_GAIN:
            arm.discount(math.exp(-(state.steps - arm.last_pull) / EVIDENCE_HORIZON))
            state.version += 1

    def _open(self, arm: ArmStats, state: BucketState, upper: float) -> bool:
        """Whether `arm` (upper bound `upper`) might still beat the incumbent by the margin.
        Drafting that gains nothing (`NO_GAIN`) is not, however its noisy timing reads: it
        cannot beat plain until a probe gains tokens (which lifts `recent_gain`). Open, it was
        probed every 8 steps, each probe a call of the model drafter's due shadow drafts."""
        return upper > 1 + self._margin(arm, state) and \
            not (arm.n_max > 0 and _gains_nothing(state))

    def _upper(self, arm: ArmStats) -> float:
        """How fast, relative to the incumbent, `arm` might still be: its measured ratio plus
        `confidence` standard errors."""
        return arm.speedup + self.config.confidence * self._sd(arm)

    def _explore(self, state: BucketState) -> int:
        """The arm to re-measure. While some arm might still beat the incumbent by the margin
        (its upper bound reaches the switching line: too few probes to tell), the most
        promising such arm, every `explore_every` steps (`BEHIND_SLOWDOWN` times that while
        it measures behind the incumbent); once none can, the arm measured longest ago, twice
        as late each time (up to the longest interval), so a settled choice costs under 1% in
        probes and still follows a workload that changes. (An inheriting bucket skips the
        measuring phase; its unmeasured arms count as open, so they are re-measured here, one
        step every `explore_every`, until they settle.)"""
        arms = state.arms
        others = [i for i in range(len(arms)) if i != state.incumbent]
        if self._sure_lead(state) and any(arms[i].n_max == 0 for i in others):
            # plain cannot win: not probed, and the pace kept, so that plain is probed within
            # `explore_every` steps of the lead falling short
            state.num_probes_skipped += 1
            others = [i for i in others if arms[i].n_max != 0]
            if not others:
                state.next_explore = state.steps + self.config.explore_every
                return state.incumbent
        others = others or [state.incumbent]
        upper = {i: self._upper(arms[i]) for i in others}
        open_arms = [i for i in others if self._open(arms[i], state, upper[i])]
        if open_arms:
            index = max(open_arms, key=upper.get)
            arm = arms[index]
            # an open arm measured behind the incumbent is probed 4x less often: where the
            # chain pays 1.4x (translation at c=8) its bursty steps kept plain open for the
            # whole run, and a plain step every 8 gives up ~1/8 x (1 - 1/1.4), ~4% of its speed
            behind = arm.compared and arm.speedup < 1.0
            ahead = arm.compared and arm.speedup > 1 + self._margin(arm, state)
            state.explore_interval = self.config.explore_every
            gap = state.explore_interval * BEHIND_SLOWDOWN if behind else \
                max(2, state.explore_interval // AHEAD_SPEEDUP) if ahead else state.explore_interval
            state.next_explore = state.steps + gap
            return index
        index = min(others, key=lambda i: arms[i].last_pull)
        state.next_explore = state.steps + state.explore_interval
        state.explore_interval = min(2 * state.explore_interval, self.config.max_explore_every)
        return index


def _next_probe(state: BucketState) -> int:
    """The step of the next re-measurement: `next_explore`, and under a plain incumbent not
    before the last probe's catch-up is paid for (`CATCH_UP_SHARE`)."""
    if state.arms[state.incumbent].n_max != 0:
        return state.next_explore
    return max(state.next_explore, state.catch_up_until)


def _gains_nothing(state: BucketState) -> bool:
    """Whether drafting has accepted (almost) nothing over its recent steps (`NO_GAIN`)."""
    return state.num_recent_steps >= NO_GAIN_STEPS and state.recent_gain < NO_GAIN


def _speedups_over_plain(state: BucketState) -> dict[str, float]:
    """Each measured arm's goodput over plain decoding's, both relative to the incumbent at the
    same moments (the incumbent's own ratio is 1)."""
    relative = {i: 1.0 if i == state.incumbent else a.speedup
                for i, a in enumerate(state.arms) if i == state.incumbent or a.compared}
    plain = relative.get(0)
    if not plain:
        return {}
    return {str(state.arms[i].n_max): round(r / plain, 3) for i, r in relative.items()}
