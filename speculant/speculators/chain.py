"""The chain: several speculators at once, one winning draft per sequence.

Every speculator a sequence may use proposes; the chain scores each proposal by its expected
accepted tokens net of the cost of verifying it (see `acceptance.py`), trims it to the length
worth verifying, and keeps the best. The winner is told `accept(n)`, the other proposers
`accept(n, is_other=True)`. Drafts that keep failing shrink the per-sequence acceptance
estimates, so the chain backs off to shorter drafts or none. A proposal that is not verified
is still scored (below), so no draft is verified just to keep an estimate honest; a model
drafter the chain stopped asking is asked for a one-token shadow draft after `probe_interval`
silent rounds, then twice as late each time until one of its drafts is verified again, and
all of a drafter's shadow drafts together take at most `PROBE_TIME_SHARE` of the time between
the chain's rounds, saved up to MAX_PROBE_CREDIT_S. `probe_interval` 0 switches back-off off: every proposal is verified (one token
at least).

Acceptance is bursty: a copy from the prompt runs for dozens of tokens, then nothing matches.
So the estimates are kept per *context*, what the speculator's previous proposal for the same
sequence showed (none, missed, matched every known token), and they learn from every proposal,
not only from winners: after each step the losing proposals (and those of a round where
nothing was worth verifying) are scored against the tokens the target committed (a
counterfactual verification, censored where the committed tokens end). Without it a drafter
that lost a few early rounds was never measured again: on rag its perfect 12-token copies
stayed unverified for 15 steps in a row, priced by its failures elsewhere.

A model drafter's tokens are priced by the probability it gave them, through its learned
acceptance per probability bin (`calibration.py`): its sure tokens are verified, its unsure ones
not, and asking it is priced by what its sure first tokens gain against its drafting time.

The chain also keeps the statistics of each speculator (calls, drafts, tokens, acceptance per
position, time in each call), as llama.cpp's `common_speculative` does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from speculant.speculators.acceptance import (
    net_gain,
    observed_acceptance,
    survival_above,
    survival_above_rates,
    worth_drafting,
)
from speculant.speculators.calibration import (
    ProbCalibration,
    SeqCalibration,
    Survival,
    WorkloadScale,
    calibrated_rates,
    record_judged,
    value_of_first,
)
from speculant.speculators.call_cost import DraftCallCost
from speculant.speculators.counters import AcceptanceCounters, total
from speculant.speculators.drafter_ledger import DrafterLedger
from speculant.speculators.model_free_rest import (
    MF_REST,
    MODEL_FREE,
    MODEL_FREE_MIN_BUCKET,
    ModelFreeRest,
)
from speculant.speculators.base import (
    CommittedTokens,
    Draft,
    DraftParams,
    DraftRequest,
    Speculator,
    SpeculatorStats,
)


# Contexts of an acceptance estimate: what the speculator's previous proposal for the sequence
# showed. A copy that matched keeps matching; a drafter that just missed mostly misses again.
NO_PROPOSAL, MISSED, MATCHED = 0, 1, 2
NUM_CONTEXTS = 3
MAX_PROBE_INTERVAL = 512  # silent rounds between shadow drafts of a model drafter, at most
# The most history a model drafter re-reads for a shadow draft or a first, not yet priced ask
# (DraftParams.context_tokens): those drafts mostly show that the drafter does not pay, and the
# 4-layer draft re-reading 7 prompts (506 rows) took 0.17 s, 8 decode steps at c=8, and one
# sequence's 148 silent tokens 3 steps (translation, F32 weights); 64 tokens of context still
# carry the local text it drafts.
PROBE_CONTEXT_TOKENS = 64
# Shadow drafts of one model drafter take at most this share of the time between the chain's
# draft rounds (each gap counted up to MAX_ROUND_GAP_S, so an idle server earns no probes).
# Per-sequence doubling alone left the 4-layer draft, priced out at c=8 on mt_bench, spending
# 0.77 s of a 12.7 s run (6%) on 82 shadow drafts of 16 sequences: each new sequence starts at
# `probe_interval` again, and each re-reads its window (6-17 ms).
PROBE_TIME_SHARE = 0.01
# Before a model drafter is priced (calibration.py: MIN_FIRST first tokens seen), at most this
# many sequences per round start reading their history for it; the others wait the few rounds
# until it is priced. Asked all at once, 8 new sequences at c=8 re-read 8 x 64 rows: the two
# first rounds of the 4-layer draft took 0.13-0.21 s of a 6.4 s translation run (3%), mostly
# to learn that it does not pay there.
FIRST_READS_PER_ROUND = 2
# ... and at most this many sequences per round get a shadow draft; the others stay due and go
# in later rounds. While the tuner decodes plain, every sequence of a c=8 batch fell due between
# two of its probes of drafting, and each probe then re-read 8 windows with the 4-layer draft
# (8 x 64 rows, ~25 ms, two decode steps): 7 such calls were 1.8% of a mt_bench run where the
# draft was never verified (0.955x plain with the tuner).
SHADOW_DRAFTS_PER_ROUND = 2
MAX_ROUND_GAP_S = 1.0
# ... and what a drafter not probed meanwhile has saved of that share is at most this: a bench
# runs every category on one engine, and the share saved at c=1, where the head was asked and
# not probed, went to probes at c=8 (translation, 16 prompts: probes 2.3% of the run, not 1%)
MAX_PROBE_CREDIT_S = 0.005


def _read_window(read_to: int | None, history_len: int, num_prompt_tokens: int,
                 priced: bool) -> int:
    """How much history a model drafter asked now re-reads (`DraftParams.context_tokens`, 0:
    all it has not read). A first ask (the drafter not priced yet), or one after the drafter
    missed more of the history than a window (it last read up to `read_to`; never, for a
    sequence that generated more than a window while the tuner decoded plain), re-reads only
    the window. A priced first read of a new sequence still reads its prompt (the draft pays on
    code edits by copying from it). Read whole, a c=8 qa run's probe of drafting under a plain
    tuner caught the 4-layer draft up on 874 rows of 4 sequences' answers, 0.52 s (13 steps;
    AMD EPYC Zen 1), for drafts that never paid there."""
    missed = history_len - (num_prompt_tokens if read_to is None else read_to)
    return PROBE_CONTEXT_TOKENS if not priced or missed > PROBE_CONTEXT_TOKENS else 0


def _silence(state: "_SeqState", history_len: int) -> int:
    """`state.silent_steps` counted up to a round at `history_len` tokens: one per token
    committed since the last round (one per step while the chain is asked and nothing is
    verified; while the tuner decodes plain, the chain only sees its probes). Counted in
    rounds, a drafter priced out before the tuner switched to plain decoding was never
    shadow-drafted again: at c=1 a request saw a handful of probes, not the 16 rounds of
    `probe_interval`, and drafting stayed off for the whole run."""
    gap = history_len - state.draft_pos if state.draft_pos >= 0 else 1
    return state.silent_steps + max(1, gap)


def _context_counters() -> list[AcceptanceCounters]:
    return [AcceptanceCounters() for _ in range(NUM_CONTEXTS)]


def _context_after(known: int, accepted: int) -> int:
    return MATCHED if accepted == known > 0 else MISSED


@dataclass(slots=True)
class _SeqState:
    types: tuple[str, ...]
    # per speculator, per context: this sequence's verified and counterfactual drafts
    counts: dict[str, list[AcceptanceCounters]] = field(default_factory=dict)
    context: dict[str, int] = field(default_factory=dict)  # per speculator, for its next draft
    proposers: tuple[str, ...] = ()  # speculators that proposed in the last draft round
    losers: tuple[Draft, ...] = ()  # the last round's proposals that were not verified, untrimmed
    winner_tokens: list[int] = field(default_factory=list)  # the winner before it was trimmed
    winner_probs: list[float] | None = None  # ... its token_probs
    # (speculator, context, untrimmed draft, its token_probs, verified length) of a winner
    # accepted in full whose trimmed tail the sampled token can still judge
    tail: tuple[str, int, list[int], list[float] | None, int] | None = None
    draft_pos: int = -1  # history length the last round drafted after
    winner: Draft | None = None
    # tokens committed since the last verified draft, this round's step included (`_silence`):
    # one per silent draft round, and every token of the steps between rounds (the tuner's
    # plain steps)
    silent_steps: int = 0
    # per model drafter: silent rounds before its next shadow draft (doubles while they fail)
    probe_every: dict[str, int] = field(default_factory=dict)
    # per model drafter: this sequence's record against the drafter's calibration
    calib: dict[str, SeqCalibration] = field(default_factory=dict)
    # per model drafter asked about it so far: the history length it was last asked at
    read_by: dict[str, int] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    # the winner's (model drafter, bucket, its rival's expected gain) for the ledger, when a
    # model drafter's draft won the round
    ledger_entry: tuple[str, int, float] | None = None


class SpeculatorChain:
    def __init__(self, speculators: list[Speculator], probe_interval: int = 16,
                 clock=time.perf_counter, rest_losers: bool | None = None):
        """`rest_losers`: whether model drafters rest where their ledger shows them losing
        (drafter_ledger.py); None: unless `probe_interval` is 0 (no back-off of any kind:
        every proposal verified)."""
        names = [s.name for s in speculators]
        if len(set(names)) != len(names):
            raise ValueError(f"speculator listed twice in the chain: {names}")
        self.speculators = {s.name: s for s in speculators}
        # a round asks the model-free speculators first (`draft`); the speculators that read
        # the target's features (`feature_rows`): fixed at load, not sorted or tested per step
        self._draft_order = sorted(self.speculators.items(), key=lambda kv: kv[1].is_model_based)
        self._feature_readers = {s.name: s for s in speculators if s.hidden_layers}
        self.stats = {name: SpeculatorStats() for name in names}
        self.probe_interval = probe_interval
        self._clock = clock  # seconds; a test drives its own
        self._seqs: dict[int, _SeqState] = {}
        self._draft_seconds = {name: 0.0 for name in names}  # per drafted position, model drafters
        # per row of a model drafter's forwards after its first one: what one more drafted
        # position costs once the call is made (about half the average above for the head)
        self._further_seconds = {name: 0.0 for name in names}
        # per speculator, per context: every sequence's verified and counterfactual drafts
        self._evidence = {name: _context_counters() for name in names}
        # per model drafter: acceptance by the probability it gave its tokens (calibration.py)
        # (from the drafter's shipped prior when it has one: priced from the first round)
        self._calibration = {s.name: ProbCalibration.seeded(s.calibration_prior)
                             for s in speculators if s.is_model_based}
        # per model drafter: how it does against its calibration on the text served lately,
        # every sequence's scale starts from it (calibration.WorkloadScale)
        self._workload = {name: WorkloadScale() for name in self._calibration}
        # per model drafter: what a first forward costs by the sequences asked (call_cost.py)
        self._call_cost = {name: DraftCallCost() for name in self._calibration}
        # Wall time of the engine's steps, measured between draft rounds (the step-cost model's
        # plain estimate read 10x short on code_edit's 2,000-token contexts at c=8)
        self._last_round: float | None = None
        # ... or, once an engine reports its steps (`observe_step`), their own time: the wall
        # time also held the other engines of an interleaved bench (five methods in 0.1 s
        # turns), which gave the 4-layer draft's shadow drafts ~5x their budget there (draft
        # share 3.8% against 2.3% run alone, qa at c=8 with the tuner)
        self._step_seconds: float | None = None
        # per model drafter: shadow-draft time it may still spend (PROBE_TIME_SHARE of the
        # steps' time, saved up to MAX_PROBE_CREDIT_S; negative after a dear probe)
        self._probe_credit = {name: MAX_PROBE_CREDIT_S for name in self._calibration}
        # the last round's model drafters reading history they had missed (see
        # `Speculator.catch_up_seconds`): the tuner does not charge it to a probe of drafting
        self.round_catch_up_seconds = 0.0
        # what each model drafter gained and cost per concurrency: it rests where it loses
        # (drafter_ledger.py); the sequences each resting drafter was told to rest
        self.ledger = DrafterLedger()
        self.rest_losers = rest_losers
        self._resting: dict[str, set[int]] = {name: set() for name in self._calibration}
        self._round_bucket = 1  # the last draft round's concurrency bucket
        self._solo_seq: int | None = None  # the last sequence that decoded alone
        # the model-free speculators' account, rests and followed copies (model_free_rest.py);
        # `_round_drafted`: the last round asked a speculator (a step without: a plain step)
        self.model_free = ModelFreeRest(self.ledger)
        self._round_drafted = False
        self._seconds_per_token = 0.0  # ... and what a plain token cost then

    @property
    def names(self) -> list[str]:
        return list(self.speculators)

    def hidden_layers(self, types) -> tuple[int, ...]:
        """Target layers the speculators `types` need captured (sorted, no duplicates)."""
        layers = set()
        for name in types:
            layers.update(self.speculators[name].hidden_layers)
        return tuple(sorted(layers))

    def feature_rows(self, seq_id: int, types, num_tokens: int, tokens_after: int = 0) -> int:
        """Of a chunk of `num_tokens` tokens of sequence `seq_id` (`tokens_after` prompt tokens
        after it), how many (the newest) the speculators `types` read the target's features of
        (0 when none reads them now)."""
        readers = self._feature_readers
        if not readers:
            return 0
        return max((readers[name].feature_rows(seq_id, num_tokens, tokens_after)
                    for name in types if name in readers), default=0)

    def check_types(self, types) -> tuple[str, ...]:
        unknown = [t for t in types if t not in self.speculators]
        if unknown:
            loaded = ", ".join(self.speculators) or "none"
            raise ValueError(f"speculator type(s) {unknown} not loaded in this engine (loaded: {loaded})")
        return tuple(types)

    # ---- lifecycle ---------------------------------------------------------------------------

    def begin(self, seq_id: int, prompt_ids: list[int], types: tuple[str, ...]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"chain: sequence {seq_id} already begun")
        types = self.check_types(types)
        self._seqs[seq_id] = _SeqState(types, {t: _context_counters() for t in types},
                                       {t: NO_PROPOSAL for t in types},
                                       num_prompt_tokens=len(prompt_ids))
        self._seqs[seq_id].calib = {t: SeqCalibration(workload=self._workload[t])
                                    for t in types if t in self._calibration}
        for name in types:
            with self._timed(name, "begin"):
                self.speculators[name].begin(seq_id, prompt_ids)

    def process(self, batch: list[CommittedTokens]) -> None:
        for c in batch:
            self._score_losers(c)
        for name, spec in self.speculators.items():
            mine = [c for c in batch if c.seq_id in self._seqs and name in self._seqs[c.seq_id].types]
            if spec.is_model_based:  # none of a dormant sequence's tokens: no call, no charge
                mine = [c for c in mine if spec.follows(c.seq_id)]
            if mine:
                t0 = self._clock()
                with self._timed(name, "process"):
                    spec.process(mine)
                if spec.is_model_based and self._seconds_per_token > 0:
                    self.ledger.charge(name, self._round_bucket,
                                       (self._clock() - t0) / self._seconds_per_token)

    def observe_step(self, seconds: float, num_decoding: int = 0) -> None:
        """The engine's step took `seconds` (drafting, forward, verification): from the first
        call on, the time between draft rounds that budgets shadow drafts is the sum of these
        (each step counted up to MAX_ROUND_GAP_S), not the wall clock. `num_decoding`: its
        decoding sequences when it was a pure decode step (no prompt chunk), else 0; such
        steps price the model-free account's drafting rounds (model_free_rest.py)."""
        self._step_seconds = (self._step_seconds or 0.0) + min(seconds, MAX_ROUND_GAP_S)
        drafted, self._round_drafted = self._round_drafted, False
        self.model_free.observe_step(seconds, num_decoding, drafted, self._seconds_per_token)

    def end(self, seq_id: int) -> None:
        state = self._seqs.pop(seq_id, None)
        if state is None:
            return
        for resting in self._resting.values():
            resting.discard(seq_id)
        self.model_free.end(seq_id)
        for name in state.types:
            self.speculators[name].end(seq_id)

    # ---- drafting ----------------------------------------------------------------------------

    def draft(self, requests: list[DraftRequest], cost_per_token: float,
              seconds_per_token: float = 0.0) -> dict[int, Draft]:
        """One round: every allowed speculator drafts for its sequences; the best draft wins.

        `cost_per_token`: verifying one draft token, in tokens' worth of step time.
        `seconds_per_token`: what one token costs in plain decoding, to price model drafters.
        """
        proposals: dict[int, list[Draft]] = {r.seq_id: [] for r in requests}
        self.round_catch_up_seconds = 0.0
        now = self._clock()
        gap = 0.0
        if self._step_seconds is not None:
            gap, self._step_seconds = self._step_seconds, 0.0
        elif self._last_round is not None:
            gap = min(now - self._last_round, MAX_ROUND_GAP_S)
        self._last_round = now
        for name, credit in self._probe_credit.items():
            self._probe_credit[name] = min(MAX_PROBE_CREDIT_S, credit + PROBE_TIME_SHARE * gap)
        self._start_round(requests)
        bucket = self._round_bucket = self._ledger_bucket([r.seq_id for r in requests])
        self._seconds_per_token = seconds_per_token
        mf_mode = self._model_free_mode(requests, bucket)
        model_seconds = 0.0  # the model drafters' calls (the rest of the round is model-free)
        # Model drafters last: they cost time per drafted position, so they only run for the
        # sequences where the model-free proposals leave them something to win.
        # best_of: seq_id -> (proposals judged, best draft, its gain), reused for the winner
        # when no model drafter added a proposal since (judging is ~20 us a sequence)
        best_of: dict[int, tuple] = {}
        for name, spec in self._draft_order:
            mine = [r for r in requests if name in self._seqs[r.seq_id].types]
            if spec.is_model_based and mine and self._rests(name, spec, mine, bucket):
                continue
            if not spec.is_model_based and mf_mode == MF_REST:
                mine = [r for r in mine if r.seq_id in self.model_free.following]
            if spec.is_model_based:
                for r in mine:
                    if best_of.get(r.seq_id, (-1,))[0] != len(proposals[r.seq_id]):
                        best_of[r.seq_id] = (len(proposals[r.seq_id]), *self._best(
                            self._seqs[r.seq_id], proposals[r.seq_id], r.params.n_min,
                            cost_per_token))
                rival = {r.seq_id: best_of[r.seq_id][2] for r in mine}
                mine = [r for r in mine if not self._outbid(name, r.seq_id, rival[r.seq_id],
                                                            cost_per_token, seconds_per_token)]
                mine = mine and self._budget_model_drafts(name, mine, cost_per_token,
                                                          seconds_per_token, rival)
            if not mine:
                continue
            t0 = self._clock()
            self._round_drafted = True
            spec.sunk_draft_seconds = spec.catch_up_seconds = 0.0
            spec.catch_up_rows, spec.first_seconds, spec.further_rows = 0, None, 0
            with self._timed(name, "draft"):
                drafts = spec.draft(mine)
            if spec.is_model_based:
                if seconds_per_token > 0:
                    self.ledger.charge(name, bucket, (self._clock() - t0) / seconds_per_token)
                spent = max(0.0, self._clock() - t0 - spec.sunk_draft_seconds)
                self._observe_draft_time(name, spent, spec.catch_up_seconds, mine, drafts)
                first = spent if spec.first_seconds is None else spec.first_seconds
                self._observe_further_time(name, spent + spec.sunk_draft_seconds - first,
                                           spec.further_rows)
                self._call_cost[name].observe(len(mine), max(
                    0.0, first - spec.sunk_draft_seconds - spec.catch_up_seconds))
                self._call_cost[name].observe_revival(spec.catch_up_rows, spec.catch_up_seconds)
                self.round_catch_up_seconds += spec.catch_up_seconds
                model_seconds += self._clock() - t0
            for r in mine:  # asked and silent: its next draft starts a new run
                if len(drafts.get(r.seq_id) or ()) == 0:
                    self._seqs[r.seq_id].context[name] = NO_PROPOSAL
            for seq_id, d in drafts.items():
                if len(d) > 0:
                    d.source = name
                    proposals[seq_id].append(d)
                    self.stats[name].num_proposals += 1
                    if name in self._calibration and d.token_probs:
                        self._calibration[name].record_first(d.token_probs[0])
        by_id = {r.seq_id: r for r in requests}
        winners: dict[int, Draft] = {}
        mf_rows = 0
        for seq_id, drafts in proposals.items():
            state = self._seqs[seq_id]
            state.proposers = tuple(d.source for d in drafts)
            known = best_of.get(seq_id)
            best = known[1] if known is not None and known[0] == len(drafts) else \
                self._best(state, drafts, by_id[seq_id].params.n_min, cost_per_token)[0]
            state.winner = best
            state.losers = tuple(d for d in drafts if best is None or d.source != best.source)
            untrimmed = None if best is None else next(d for d in drafts if d.source == best.source)
            state.winner_tokens = [] if untrimmed is None else untrimmed.token_ids
            state.winner_probs = None if untrimmed is None else untrimmed.token_probs
            state.ledger_entry = None
            model_free = None if best is None else best.source not in self._resting
            if best is not None:
                state.silent_steps = 0
                winners[seq_id] = best
            if model_free is False:  # a model drafter's: its rows and gain booked
                self.ledger.charge(best.source, bucket, len(best) * cost_per_token)
                rival = best_of.get(seq_id, (0, None, 0.0))[2]
                state.ledger_entry = (best.source, bucket, max(0.0, rival))
            if self.model_free.winner(seq_id, mf_mode, model_free):
                mf_rows += len(best)
                state.ledger_entry = (MODEL_FREE, bucket, 0.0)
        if seconds_per_token > 0:  # booked once the step is timed (drafting rounds only)
            self.model_free.book_round(mf_mode, bucket, len(requests), mf_rows * cost_per_token,
                                       (self._clock() - now - model_seconds) / seconds_per_token,
                                       model_seconds == 0.0)
        return winners

    def _model_free_mode(self, requests: list[DraftRequest], bucket: int) -> int:
        """What the model-free speculators do this round (`ModelFreeRest.mode`)."""
        enabled = self._rests_losers() and bucket >= MODEL_FREE_MIN_BUCKET
        asked = enabled and any(not self.speculators[name].is_model_based
                                for r in requests for name in self._seqs[r.seq_id].types)
        return self.model_free.mode(bucket, enabled, asked)

    def decides_drafting(self, types_per_seq: list[tuple[str, ...]], num_decoding: int,
                         solo: int | None = None) -> bool:
        """Whether the chain itself decides whether drafting pays for a step of `num_decoding`
        decoding sequences using the speculators `types_per_seq` (per sequence; `solo`: the
        sequence's id when one decodes alone). The engine's tuner then leaves the step alone
        (`SpecTuner.leave_to_chain`). So it does where each of them is model-free with their
        account booking this concurrency (model_free_rest.py), or a model drafter the ledger
        rests through the step: the tuner scoring those steps measured drafting that the
        ledger had switched off. (On 13 code_edit prompts at c=8, where the 4-layer draft reads
        1.55x plain, a 64-round rest in bucket 8 read to the tuner as drafting that gains
        nothing, and it switched to plain for the rest of the run: 1.04x; Intel Xeon with
        AMX, issue 18's command, 2026-12-06 17:10 UTC.)"""
        names = {name for types in types_per_seq for name in types}
        if not names or not self._rests_losers():
            return False
        bucket = self.ledger.bucket(num_decoding)
        for name in names:
            if not self.speculators[name].is_model_based:
                if bucket < MODEL_FREE_MIN_BUCKET:
                    return False
            elif not self._ledger_rests(name, bucket, solo):
                return False
        return True

    def _ledger_rests(self, name: str, bucket: int, solo: int | None) -> bool:
        """Whether model drafter `name` rests through the next round of `bucket` (`solo`: the
        sequence decoding alone, whose bucket-1 record starts over when it is a new one:
        `_ledger_bucket`)."""
        if bucket == 1 and solo != self._solo_seq:
            return False
        return self.ledger.account(name, bucket).rest_left > 0

    def _rests_through(self, name: str, bucket: int) -> bool:
        """Whether speculator `name` is not asked at all in the next round of `bucket`: a model
        drafter resting, a model-free one resting and not probing (`_model_free_mode`)."""
        if name in self._resting:
            return self.ledger.account(name, bucket).rest_left > 0
        return name in self.speculators and self.model_free.rests_through(bucket)

    def _rests_losers(self) -> bool:
        return self.probe_interval > 0 if self.rest_losers is None else self.rest_losers

    def _ledger_bucket(self, seq_ids: list[int]) -> int:
        """The ledger's bucket of a round drafting for `seq_ids`; a sequence decoding alone
        that is not the one before (a new request) starts bucket 1's accounts over."""
        if len(seq_ids) == 1 and seq_ids[0] != self._solo_seq:
            self._solo_seq = seq_ids[0]
            for name in self._resting:
                self.ledger.restart(name, 1)
        return self.ledger.bucket(len(seq_ids))

    def resting_round(self, seqs: list[tuple[int, tuple[str, ...]]]) -> bool:
        """A draft round for `seqs` ((seq_id, speculator types) each) in which every one of
        their speculators is a model drafter resting through it: the round is counted, new
        sequences are told to rest, and True says there is nothing to draft (the engine then
        builds no request: per sequence and step that cost ~1% of a c=8 run where `eagle3`
        rested). False: draft as usual (`draft`)."""
        names = {name for _, types in seqs for name in types}
        bucket = self._ledger_bucket([seq_id for seq_id, _ in seqs])
        if not self._rests_losers() or not all(self._rests_through(name, bucket)
                                               for name in names):
            return False
        if any(name not in self._resting for name in names):
            if any(seq_id in self.model_free.following for seq_id, _ in seqs):
                return False  # a copy under way: draft for it (model_free_rest.py)
            self.model_free.count_rest_round(bucket)
        self._round_bucket = bucket
        for name in names & self._resting.keys():
            self.ledger.resting(name, bucket)
            resting, spec = self._resting[name], self.speculators[name]
            for seq_id, types in seqs:
                if name in types and seq_id not in resting:
                    resting.add(seq_id)
                    spec.rest(seq_id)
        return True

    def _rests(self, name: str, spec: Speculator, requests: list[DraftRequest],
               bucket: int) -> bool:
        """Whether model drafter `name` rests this round (drafter_ledger.py): its sequences are
        told to rest while it does, and woken (their features kept again) when it no longer
        does, so that the trial that follows a rest can draft."""
        resting = self._resting[name]
        if self._rests_losers() and self.ledger.resting(name, bucket):
            for r in requests:
                if r.seq_id not in resting:
                    resting.add(r.seq_id)
                    spec.rest(r.seq_id)
            return True
        for r in requests:
            if r.seq_id in resting:
                resting.discard(r.seq_id)
                spec.wake(r.seq_id, len(r.token_ids))
        return False

    def shadow(self, requests: list[DraftRequest]) -> None:
        """A round where nothing is verified (the tuner decodes plain): the model-free
        speculators still propose, and their proposals are scored against the committed tokens
        as a round's losers are, so each speculator's context and record follow the text
        through plain steps. (Blind through them, the chain met a probe of drafting with the
        contexts of the step before the switch: on mt_bench at c=8, switched off in a dry
        spell, 3 of 4 probes over 90 steps verified nothing while the same text drafted at
        other runs' pace committed 1.7 tokens per sequence per step.) Model drafters are not
        asked: they cost time per position; their silence goes on counting (`_silence`)."""
        self._start_round(requests)
        self._round_drafted = True
        for r in requests:
            state = self._seqs[r.seq_id]
            state.proposers, state.losers, state.winner = (), (), None
        for name, spec in self.speculators.items():
            mine = [r for r in requests if name in self._seqs[r.seq_id].types]
            if spec.is_model_based or not mine:
                continue
            with self._timed(name, "draft"):
                drafts = spec.draft(mine)
            for r in mine:
                state, d = self._seqs[r.seq_id], drafts.get(r.seq_id)
                if d is None or len(d) == 0:
                    state.context[name] = NO_PROPOSAL
                    continue
                d.source = name
                state.losers += (d,)
                self.stats[name].num_proposals += 1

    def _start_round(self, requests: list[DraftRequest]) -> None:
        """A round drafts after each request's history: its step is silent until a draft of it
        is verified (`_silence`)."""
        for r in requests:
            state = self._seqs[r.seq_id]
            state.silent_steps = _silence(state, len(r.token_ids))
            state.draft_pos = len(r.token_ids)

    def _budget_model_drafts(self, name: str, requests: list[DraftRequest], cost_per_token: float,
                             seconds_per_token: float, rival: dict[int, float]) -> list[DraftRequest]:
        """A model drafter costs time per drafted position whether or not its draft wins: cap
        each sequence's n_max where expected acceptance stops paying for drafting + verifying,
        and skip the sequence when even that cannot beat the net gain `rival[seq_id]` of the
        best model-free proposal (a one-token shadow draft after `probe_interval` silent
        rounds when nothing else drafts: scored against the committed tokens, not verified).
        Once the drafter's first-token probabilities are known (calibration.py), asking is
        priced by what its confident tokens gain, a token joins the draft while the product of
        its probabilities still pays for verifying it (`p_min_run`), and a further forward runs
        where such forwards have gained more than they cost (`further_cost`, continuation.py).
        (With the drafter's average cost per position inside p_min_run, first forward
        included, the head drafted 1.30 tokens per draft on mt_bench at c=1.)"""
        draft_cost = self._draft_seconds[name] / seconds_per_token if seconds_per_token > 0 else 0.0
        further_cost = self._further_seconds[name] / seconds_per_token \
            if seconds_per_token > 0 and self._further_seconds[name] > 0 else draft_cost
        cal = self._calibration.get(name)
        first = None if cal is None else cal.first_rates()
        # every context, every sequence (needed only while first tokens do not price it yet)
        evidence = total(self._evidence[name]) if first is None else None
        values = {} if first is None else {r.seq_id: value_of_first(
            first, cost_per_token + max(0.0, rival[r.seq_id]), self._seqs[r.seq_id].calib[name].scale)
            - self._revival_cost(name, r.seq_id, seconds_per_token) for r in requests}
        asked = self._worth_asking(name, values, draft_cost, seconds_per_token)
        out, num_first_reads, num_shadows = [], 0, 0
        for r in requests:
            state = self._seqs[r.seq_id]
            value = values.get(r.seq_id)
            run_floor = 0.0
            if value is not None:
                n = r.params.n_max if r.seq_id in asked else 0
                run_floor = min(1.0, cost_per_token)
            else:
                surv = self._survival_any_context(state, name, r.params.n_max,
                                                  cost_per_token + draft_cost, evidence)
                n = worth_drafting(surv, cost_per_token + draft_cost)
                if n > 0 and net_gain(surv, n, cost_per_token + draft_cost) <= rival[r.seq_id]:
                    n = 0
                if n > 0 and name not in state.read_by and self.probe_interval > 0:
                    num_first_reads += 1  # a first ask, not priced yet: a few per round
                    n = n if num_first_reads <= FIRST_READS_PER_ROUND else 0
            every = state.probe_every.get(name, self.probe_interval)
            window = _read_window(state.read_by.get(name), len(r.token_ids),
                                  state.num_prompt_tokens, priced=value is not None)
            if n == 0 and state.silent_steps > every and rival[r.seq_id] <= 0 \
                    and (num_shadows < SHADOW_DRAFTS_PER_ROUND or self.probe_interval == 0) \
                    and self._may_probe(name, seconds_per_token):
                num_shadows += 1
                n, window = 1, PROBE_CONTEXT_TOKENS  # a shadow draft: the silence count
                state.silent_steps = 1  # restarts at this (silent) step, and the next one
                # comes twice as late (measured: one every 16 rounds cost eagle3 6% of a c=8
                # run where it never paid)
                state.probe_every[name] = min(2 * every, MAX_PROBE_INTERVAL)
            if n > 0:
                state.read_by[name] = len(r.token_ids)
                out.append(DraftRequest(r.seq_id, r.token_ids, DraftParams(
                    n_max=min(n, r.params.n_max), n_min=min(r.params.n_min, n), p_min=r.params.p_min,
                    p_min_run=max(r.params.p_min_run, run_floor), context_tokens=window,
                    further_cost=max(r.params.further_cost, further_cost),
                    survival=None if cal is None else Survival(cal, state.calib[name].scale)),
                    r.draws, r.num_prompt_tokens))
        return out

    def _outbid(self, name: str, seq_id: int, rival: float, cost_per_token: float,
                seconds_per_token: float) -> bool:
        """Whether the best model-free draft's net gain `rival` leaves asking drafter `name`
        for `seq_id` worth less than the least a sequence's share of a call costs
        (`_ask_floor`): `_budget_model_drafts` would not ask it then, and not being asked with
        a rival drafting, it gets no shadow draft either, so it is not even priced (exact: the
        same drafts). Priced at every step, the head cost ~30 us a step on summarization at
        c=1, where the n-gram drafts win; outbid only where even its best first token lost,
        it was still priced at 70% of the steps there (a dormant sequence's revival and its
        share of a call then cost more than the draft's expected gain)."""
        cal = self._calibration.get(name)
        first = None if cal is None or rival <= 0 else cal.first_rates()
        if first is None:
            return False
        if cost_per_token + rival >= 1.0:
            return True  # no first token gains more than 1: the value is 0, the floor >= 0
        scale = self._seqs[seq_id].calib[name].scale
        floor = self._ask_floor(name, seconds_per_token)
        # the best bin's gain bounds the value: where even that is below the floor, the pass
        # over the bins is not needed (exact: the same verdict)
        if cal.value_bound(cost_per_token + rival, scale) <= floor:
            return True
        value = value_of_first(first, cost_per_token + rival, scale)
        # a revival (>= 0) only lowers the value: priced only where the value alone clears the
        # floor (on rag at c=1 pricing it was a third of this check's ~20 us a step)
        return value <= floor or \
            value - self._revival_cost(name, seq_id, seconds_per_token) <= floor

    def _ask_floor(self, name: str, seconds_per_token: float) -> float:
        """The value (tokens' worth) a sequence's ask of `name` must beat to be in any set
        `_worth_asking` picks: the per-sequence part of a call's cost once that is known (a
        set's total gain grows by a sequence's value less that part), else the price of a
        drafted position."""
        call = self._call_cost[name]
        if seconds_per_token <= 0:
            return 0.0
        if call.known:
            return call.per_seq_s / seconds_per_token
        return self._draft_seconds[name] / seconds_per_token

    def _revival_cost(self, name: str, seq_id: int, seconds_per_token: float) -> float:
        """Tokens' worth of the rows asking `name` for `seq_id` would compute only because it
        stopped following the sequence (`call_cost.py`)."""
        if seconds_per_token <= 0:
            return 0.0
        rows = self.speculators[name].revival_rows(seq_id)
        return self._call_cost[name].revival_seconds(rows) / seconds_per_token if rows else 0.0

    def _worth_asking(self, name: str, values: dict[int, float], draft_cost: float,
                      seconds_per_token: float) -> set[int]:
        """The sequences to ask `name` for first tokens, given each one's expected gain
        (`values`, tokens' worth): once its call cost is known, the set with the best total
        gain net of what a first forward for that many sequences costs (`call_cost.py`: the
        sequences with the highest values, or none); before, those whose value beats the
        per-position price `draft_cost`."""
        call = self._call_cost[name]
        if not call.known or seconds_per_token <= 0:
            return {seq_id for seq_id, v in values.items() if v > draft_cost}
        return set(best_ask_set(values, lambda k: call.seconds(k) / seconds_per_token))

    def _may_probe(self, name: str, seconds_per_token: float) -> bool:
        """Whether `name`'s shadow drafts are within their share of the time between rounds
        (always without back-off, or while a plain token's time is unknown: the drafter cannot
        be priced then). A round's due probes all go: they share a call."""
        return self.probe_interval == 0 or seconds_per_token <= 0 or \
            self._probe_credit[name] > 0.0

    def _observe_draft_time(self, name: str, seconds: float, catch_up_seconds: float,
                            requests: list[DraftRequest], drafts: dict[int, Draft]) -> None:
        """Book a draft call: its time per drafted position, catch-up left out, prices asking
        the drafter (an EMA); the share of calls that re-read a history window (shadow drafts,
        first asks before the drafter is priced) counts against the probe budget, catch-up
        included. (Priced with its catch-up, a one-token probe of the 4-layer draft cost 6-17
        ms, ~10x a drafted position at c=8, and kept the drafter priced out for good.)"""
        windowed = sum(r.params.context_tokens > 0 for r in requests)
        if windowed:
            self._probe_credit[name] -= seconds * windowed / len(requests)
        num_positions = sum(len(d) for d in drafts.values())
        if num_positions > 0:  # EMA of seconds per drafted (sequence, position)
            per = max(0.0, seconds - catch_up_seconds) / num_positions
            self._draft_seconds[name] = _ema(self._draft_seconds[name], per)

    def _observe_further_time(self, name: str, seconds: float, rows: int) -> None:
        """Book a draft call's forwards after the first: `rows` (sequence, position) rows in
        `seconds`; an EMA of seconds per row prices one more forward (`further_cost`)."""
        if rows > 0:
            self._further_seconds[name] = _ema(self._further_seconds[name],
                                               max(0.0, seconds) / rows)

    def _best(self, state: _SeqState, drafts: list[Draft], n_min: int,
              cost_per_token: float) -> tuple[Draft | None, float]:
        """The draft (trimmed to the length worth verifying) with the highest expected net gain,
        and that gain (0 without one)."""
        best, best_gain = None, 0.0
        for d in drafts:
            surv = self._draft_survival(state, d, cost_per_token)
            length = worth_drafting(surv, cost_per_token)
            if length == 0 and self.probe_interval == 0:
                length = 1  # no back-off at all (probe_interval 0): every proposal is verified
            if length == 0 or length < n_min:
                continue
            gain = net_gain(surv, length, cost_per_token)
            if best is None or gain > best_gain:
                best, best_gain = d.prefix(length), gain
        return best, best_gain

    def _draft_survival(self, state: _SeqState, d: Draft, floor: float) -> list[float]:
        """Survival of `d`'s positions (`survival_above` `floor`). A model drafter's tokens:
        their calibrated rates (calibration.py). Others: the speculator's verified record, then
        its record in the sequence's current context, then the sequence's own record in that
        context, each shrunk towards the one before."""
        probs = d.token_probs
        if probs is None and d.expected_accepted is not None and len(d):
            # Only an overall estimate: the per-position rate a with sum_{i<=k} a^i close to it.
            probs = [_rate_for_expected(d.expected_accepted, len(d))] * len(d)
        name, ctx = d.source, state.context[d.source]
        if name in self._calibration and d.token_probs is not None:
            return survival_above_rates(
                calibrated_rates(self._calibration[name], state.calib[name], d.token_probs), floor)
        return survival_above([self.stats[name], self._evidence[name][ctx]],
                              state.counts[name][ctx], len(d), floor, probs)

    def _survival_any_context(self, state: _SeqState, name: str, length: int, floor: float,
                              evidence: AcceptanceCounters) -> list[float]:
        """Survival of `name`'s next draft over all contexts (`evidence`: the speculator's, all
        contexts totalled): what asking a model drafter is priced by. (Priced by the context, a
        head whose last draft matched was asked at c=8 for drafts its own low confidence then
        kept from verification: 5% of the time spent drafting for nothing.)"""
        return survival_above([self.stats[name], evidence], total(state.counts[name]), length,
                              floor)

    def _observe(self, state: _SeqState, name: str, known: int, accepted: int) -> None:
        """One (verified or counterfactual) draft of `name`: `known` positions judged, the
        first `accepted` of them right; it also sets the context of `name`'s next draft."""
        ctx = state.context[name]
        self._evidence[name][ctx].record_draft(known, accepted)
        state.counts[name][ctx].record_draft(known, accepted)
        state.context[name] = _context_after(known, accepted)

    def _calibrate(self, state: _SeqState, name: str, token_probs: list[float] | None,
                   known: int, accepted: int, first_pos: int = 0) -> None:
        """A model drafter's draft judged (verified or scored): its calibration learns
        (`first_pos`: the draft position of token_probs[0])."""
        if name in self._calibration and token_probs:
            record_judged(self._calibration[name], state.calib[name], token_probs, known,
                          accepted, first_pos)

    def _score_losers(self, c: CommittedTokens) -> None:
        """Score the last round's unverified proposals against what the target committed after
        the same point (the step's kept inputs after the first, and its sampled token)."""
        state = self._seqs.get(c.seq_id)
        if state is None or not (state.losers or state.tail):
            return
        losers, tail, state.losers, state.tail = state.losers, state.tail, (), None
        if c.next_token_id is None or c.start_pos != state.draft_pos - 1:
            return  # not the step that followed the draft round
        truth = list(c.token_ids[1:]) + [c.next_token_id]
        for d in losers:
            known, accepted = observed_acceptance(d.token_ids, truth)
            if known:
                self._observe(state, d.source, known, accepted)
                self._calibrate(state, d.source, d.token_probs, known, accepted)
                self.stats[d.source].num_scored += 1
                self.stats[d.source].num_scored_first_matched += int(accepted > 0)
                if accepted:  # a shadow draft that matched: probe at the base rate again
                    state.probe_every.pop(d.source, None)
        if tail is not None:  # the winner was trimmed: its next token meets the sampled one
            name, ctx, tokens, probs, pos = tail
            hit = len(truth) > pos and tokens[pos] == truth[pos]
            self._evidence[name][ctx].record_position(pos, hit)
            state.counts[name][ctx].record_position(pos, hit)
            if probs is not None:  # one token, judged with all before it right
                self._calibrate(state, name, probs[pos:pos + 1], 1, int(hit), pos)

    def accept(self, seq_id: int, num_accepted: int) -> None:
        """The winning draft of `seq_id` had `num_accepted` tokens accepted."""
        state = self._seqs[seq_id]
        winner = state.winner
        if winner is None:
            raise ValueError(f"chain: sequence {seq_id} has no draft to accept")
        if not 0 <= num_accepted <= len(winner):
            raise ValueError(f"chain: {num_accepted} accepted of a {len(winner)}-token draft")
        self.stats[winner.source].record_verified(len(winner), num_accepted)
        if state.ledger_entry is not None:
            name, bucket, rival = state.ledger_entry
            self.ledger.credit(name, bucket, num_accepted - rival)
            state.ledger_entry = None
        self.model_free.verdict(seq_id, num_accepted == len(winner))
        state.probe_every.pop(winner.source, None)  # verified again: probe at the base rate
        ctx = state.context[winner.source]
        self._observe(state, winner.source, len(winner), num_accepted)
        self._calibrate(state, winner.source, winner.token_probs, len(winner), num_accepted)
        if num_accepted == len(winner) < len(state.winner_tokens):
            state.tail = (winner.source, ctx, state.winner_tokens, state.winner_probs,
                          num_accepted)
        for name in state.proposers:
            with self._timed(name, "accept"):
                self.speculators[name].accept(seq_id, num_accepted, name != winner.source)
        state.winner = None

    def save(self) -> None:
        for spec in self.speculators.values():
            spec.save()

    # ---- bookkeeping -------------------------------------------------------------------------

    def _timed(self, name: str, call: str):
        return _CallTimer(self.stats[name], call)


def _ema(old: float, new: float, weight: float = 0.2) -> float:
    """A time average that gives `new` `weight` (0 `old` = nothing seen yet: `new` itself)."""
    return (1.0 - weight) * old + weight * new if old else new


def best_ask_set(values: dict[int, float], cost_of) -> list[int]:
    """The keys of `values` whose asking gains most in total net of `cost_of(k)` (the cost of
    asking k of them): the k highest values for the best k, or none when no k gains."""
    ranked = sorted(values, key=values.__getitem__, reverse=True)
    best_k, best_gain, gain = 0, 0.0, 0.0
    for k, seq_id in enumerate(ranked, start=1):
        gain += values[seq_id]
        if gain - cost_of(k) > best_gain:
            best_k, best_gain = k, gain - cost_of(k)
    return ranked[:best_k]


def _rate_for_expected(expected: float, length: int) -> float:
    """The a in [0, 1] whose geometric series sum_{i=1..length} a^i equals `expected` (bisection)."""
    target = min(max(expected, 0.0), float(length))
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        if sum(mid ** i for i in range(1, length + 1)) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class _CallTimer:
    __slots__ = ("stats", "call", "t0")

    def __init__(self, stats: SpeculatorStats, call: str):
        self.stats, self.call = stats, call

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        elapsed = time.perf_counter() - self.t0
        s = self.stats
        if self.call == "begin":
            s.num_calls_begin += 1
            s.time_begin_s += elapsed
        elif self.call == "draft":
            s.num_calls_draft += 1
            s.time_draft_s += elapsed
        elif self.call == "accept":
            s.num_calls_accept += 1
            s.time_accept_s += elapsed
        else:
            s.time_process_s += elapsed
        return False
