"""The engine: many sequences decoded together, every draft verified in one batched forward.

One `step()`:
  1) schedule: admit waiting requests, cut prompt chunks, collect decoding sequences;
  2) draft: the speculator chain proposes a draft for each decoding sequence;
  3) forward: one target forward over prompt chunks and `[last, d1..dk]` of every decoder;
  4) verify: per sequence, accept the longest draft prefix the target agrees with, plus one
     target token (lossless: greedy, sample-and-match or rejection sampling);
  5) commit: the KV cache keeps the accepted entries and rolls back the rest (O(1)), the
     speculators see what was committed, stop conditions are checked.
"""
from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from speculant.engine.config import EngineConfig
from speculant.engine.detokenizer import Detokenizer
from speculant.engine.forward_batch import SeqChunk, build_forward_batch
from speculant.engine.kv_cache import KV_DTYPES
from speculant.kernels.argmax import row_argmax
from speculant.kernels.kv_layout import check_tile_shape
from speculant.kernels.native import kernel_path, tile_kv_cache
from speculant.models.loader import load_model
from speculant.models.hybrid import hybrid_model
from speculant.models.llama import Model
from speculant.engine.sampler import Sampler
from speculant.engine.sampling_params import SamplingParams
from speculant.engine.scheduler import Scheduler
from speculant.engine.sequence import Sequence
from speculant.engine.state_rounds import StateRounds
from speculant.speculators.base import (CommittedTokens, Draft, DraftParams, DraftRequest, Speculator,
                                        SpeculatorContext, SpeculatorStats, StepFeatures,
                                        TargetDraws, TargetView)
from speculant.speculators.chain import SpeculatorChain
from speculant.speculators.factory import create_speculators
from speculant.engine.step_cost import StepCostModel
from speculant.engine.tuner import SpecTuner, TunerConfig
from speculant.models.tokenizer import load_tokenizer
from speculant.engine.verify import VerifyResult, verify_greedy, verify_match, verify_rejection

log = logging.getLogger("speculant")


@dataclass(slots=True)
class StepUpdate:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool
    new_text: str = ""  # the text those tokens completed (incremental; stop strings cut)


@dataclass(slots=True)
class EngineStatus:
    max_num_seqs: int
    running: list[Sequence]  # admitted sequences (prefilling or decoding)
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_steps: int
    num_speculator_errors: int
    num_preemptions: int  # sequences whose KV was dropped to make room (then recomputed)
    tuner: dict | None = None  # SpecTuner.summary() when the tuner runs
    # per model drafter, per concurrency bucket: its rests (chain's DrafterLedger.summary())
    rests: dict | None = None


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_decode_steps: int = 0
    num_forward_tokens: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    time_draft_s: float = 0.0
    time_forward_s: float = 0.0
    time_verify_s: float = 0.0
    num_speculator_errors: int = 0
    decode_time_s: float = 0.0  # wall time of steps with no prompt chunk (pure decode)
    decode_tokens: int = 0  # tokens those steps produced
    prefill_time_s: float = 0.0  # wall time of steps with a prompt chunk


class Engine:
    def __init__(self, config: EngineConfig | None = None, *, model_from: Engine | None = None,
                 **overrides):
        """`model_from`: an engine whose loaded target (weights, tokenizer) this one shares,
        with its own KV cache, scheduler, speculators and tuner (`Engine.sibling`)."""
        self.config = config = config or EngineConfig(**overrides)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if model_from is None:
            loaded = load_model(config.model, config.dtype)
            self.model = (hybrid_model(loaded.config, loaded.weights, config.device)
                          if loaded.config.is_hybrid
                          else Model(loaded.config, loaded.weights, config.device))
            self.tokenizer = load_tokenizer(loaded.files)
        else:
            _check_same_target(model_from.config, config)
            loaded, self.model, self.tokenizer = model_from._loaded, model_from.model, model_from.tokenizer
        self._loaded = loaded
        self.model_config = loaded.config
        self.model_path = loaded.files.path
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        _resolve_kv_dtype(config, loaded.config.head_dim)
        self.cache = self.model.new_kv_cache(
            -(-config.kv_cache_tokens // config.block_size), config.block_size,
            KV_DTYPES[config.kv_dtype])
        self._check_cache_holds_context()
        # hybrid models: recurrent state rolled back after each speculative round
        self.state_rounds = (StateRounds(self.model, self.cache, config.spec_ckpt_mode,
                                         1 + config.spec_n_max, config.max_num_seqs)
                             if loaded.config.is_hybrid else None)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_queue, config.max_prefill_chunk_decoding)
        self.eos_token_ids = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        self._spec_ctx = ctx = SpeculatorContext(vocab_size=loaded.config.vocab_size,
                                eos_token_ids=tuple(self.eos_token_ids),
                                max_seq_len=self.max_model_len, device=config.device,
                                tokenizer=self.tokenizer, target=TargetView(
                                    loaded.config, self.model_path, self.model.embed_tokens,
                                    self.model.final_norm, self.model.lm_head,
                                    embed_table=getattr(self.model, "embed", None)),
                                kv_dtype=config.kv_dtype)
        self.chain = SpeculatorChain(create_speculators(config, ctx))
        self.cost = StepCostModel()
        self.tuner = SpecTuner(TunerConfig(), config.spec_n_max) if config.spec_tune else None
        self._tuned_n_max: int | None = None  # the tuner's draft limit for the current step
        self._tuner_pulled = False  # whether the tuner chose this step's limit (and scores it)
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        # Everything loaded so far (torch, the model, tokenizer tables) lives as long as the
        # process: move it out of the cyclic GC's reach. Otherwise the GC's periodic full
        # collections, set off by the many small objects each step allocates, walk that whole
        # heap: ~10% of a decode step at context 1000 (measured).
        gc.freeze()

    def sibling(self, **overrides) -> Engine:
        """A second engine on this one's loaded target (no second copy of the weights), with
        its own KV cache, speculators, tuner and statistics: `overrides` change its config
        (not the model, dtype or device). The bench runs one per method, interleaved in time."""
        return Engine(dataclasses.replace(self.config, **overrides), model_from=self)

    def _check_cache_holds_context(self) -> None:
        """A sequence can never outgrow the whole KV cache: when the cache holds fewer tokens
        than the context, the context shrinks to it (with a warning), so requests get a clear
        limit instead of endless preemption."""
        capacity = self.cache.capacity_tokens
        if capacity < self.max_model_len:
            log.warning("KV cache (%d tokens) cannot hold one request of max_model_len %d: "
                        "requests are limited to %d tokens; raise --kv-cache-tokens",
                        capacity, self.max_model_len, capacity)
            self.max_model_len = capacity

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, hidden_layers: tuple[int, ...] = ()) -> Sequence:
        """Queue a request. `hidden_layers`: target layers whose residual stream (before the
        final norm) is kept for every token the target processes for it, returned by
        `captured_hidden_states` (the seeds' pre-norm embeddings API)."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(prompt_ids, params, request_id)
        hidden_layers = self._check_layers(hidden_layers)
        seq_id = next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}"
        seq = Sequence(seq_id=seq_id, request_id=request_id, prompt_ids=prompt_ids, params=params,
                       sampler=Sampler(params, self.model_config.vocab_size),
                       capture_layers=hidden_layers, captured={i: [] for i in hidden_layers},
                       detokenizer=Detokenizer(self.tokenizer, params.stop))
        seq.spec_types = self._spec_types(params)
        self.scheduler.add(seq)
        self._by_request[request_id] = seq
        if seq.spec_types:
            self.chain.begin(seq_id, prompt_ids, seq.spec_types)
        return seq

    def _validate(self, prompt_ids: list[int], params: SamplingParams, request_id) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if request_id is not None and request_id in self._by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; the context holds "
                             f"{self.max_model_len} (prompt must leave room for one token)")
        if params.spec.verify == "greedy" and not params.is_greedy:
            raise ValueError("verify 'greedy' needs temperature 0; use 'match' or 'rejection'")

    def _check_layers(self, layers) -> tuple[int, ...]:
        num_layers = self.model_config.num_layers
        layers = tuple(sorted(set(int(i) for i in layers)))
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"hidden layer {bad[0]} outside the model's layers [0, {num_layers})")
        return layers

    def captured_hidden_states(self, seq: Sequence) -> dict[int, torch.Tensor]:
        """layer -> [num tokens processed, hidden]: row i is the residual stream after that
        layer at position i (prompt, then generated tokens; the last sampled token was never
        processed, so it has no row)."""
        hidden = self.model_config.hidden_size
        return {i: torch.cat(rows) if rows else torch.zeros(0, hidden)
                for i, rows in seq.captured.items()}

    def _spec_types(self, params: SamplingParams) -> tuple[str, ...]:
        if not params.spec.enabled or not self.chain.names:
            return ()
        if params.spec.types is None:
            return tuple(self.chain.names)
        return self.chain.check_types(params.spec.types)

    def _tuner_choice(self, step) -> int | None:
        """The tuner's draft limit: a decode-only step is one pull of its bandit; steps with
        prompt chunks use its best limit (their time says little about drafting)."""
        self._tuner_pulled = False
        if self.tuner is None or not step.decode:
            return None
        alone = step.decode[0].seq_id if len(step.decode) == 1 else None
        if self.chain.decides_drafting([s.spec_types for s in step.decode], len(step.decode),
                                       solo=alone):
            if not step.prefill:
                self.tuner.leave_to_chain(len(step.decode))
            return None
        if step.prefill:
            return self.tuner.best(len(step.decode))
        self._tuner_pulled = True
        return self.tuner.choose(len(step.decode), alone=alone)

    def _n_max(self, params: SamplingParams) -> int:
        """The request's own draft limit, else the tuner's for this step, else the engine's."""
        if params.spec.n_max is not None:
            return params.spec.n_max
        return self.config.spec_n_max if self._tuned_n_max is None else self._tuned_n_max

    def abort(self, request_id: str) -> bool:
        seq = self._by_request.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self._finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def reset_stats(self, speculators: bool = True) -> None:
        """Fresh statistics; with `speculators`, fresh speculator state and step-cost fit too
        (nothing learned from earlier requests carries over: the chain's drafting decisions in
        one benchmark run never depend on which runs came before it)."""
        if self.has_unfinished():
            raise RuntimeError("reset_stats while requests are running")
        self.stats = EngineStats()
        if speculators:
            self.chain = SpeculatorChain(create_speculators(self.config, self._spec_ctx))
            self.cost = StepCostModel()
            if self.tuner is not None:
                self.tuner = SpecTuner(self.tuner.config, self.config.spec_n_max)

    def release(self, seq: Sequence) -> None:
        """Forget a finished request (its id can be reused)."""
        if seq.is_finished:
            self._by_request.pop(seq.request_id, None)

    def run_to_completion(self, prompts: list, params: SamplingParams) -> list[Sequence]:
        """Add every prompt, step until all finish, release them (benchmarks and tests: no
        streaming, no late arrivals)."""
        seqs = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        for seq in seqs:
            self.release(seq)
        return seqs

    # ---- the engine's public surface (server, CLI, bench) -----------------------------------

    def set_limits(self, max_num_seqs: int | None = None, max_queue: int | None = None) -> None:
        """Change how many sequences decode together and how many requests may wait beyond
        the free slots (the one queue bound: `add_request` raises QueueFullError past it)."""
        if max_num_seqs is not None:
            if max_num_seqs < 1:
                raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
            self.scheduler.max_num_seqs = max_num_seqs
        if max_queue is not None:
            if max_queue < 1:
                raise ValueError(f"max_queue must be >= 1, got {max_queue}")
            self.scheduler.max_queue = max_queue

    def set_tuning(self, enabled: bool) -> None:
        """Switch the online tuner on (a fresh one, nothing measured) or off, between runs."""
        if self.has_unfinished():
            raise RuntimeError("set_tuning while requests are running")
        if not enabled:
            self.tuner = None
        elif self.tuner is None:
            self.tuner = SpecTuner(TunerConfig(), self.config.spec_n_max)

    def status(self) -> EngineStatus:
        """What is running, waiting and free right now (for /metrics, /slots, logs)."""
        cache = self.cache
        return EngineStatus(
            max_num_seqs=self.scheduler.max_num_seqs, running=list(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_blocks=cache.num_blocks,
            num_free_blocks=cache.num_free_blocks, block_size=cache.block_size,
            num_steps=self.stats.num_steps, num_speculator_errors=self.stats.num_speculator_errors,
            num_preemptions=self.scheduler.num_preemptions,
            tuner=None if self.tuner is None else self.tuner.summary(),
            rests=self.chain.ledger.summary() or None)

    @property
    def speculator_names(self) -> list[str]:
        return self.chain.names

    def speculator_stats(self) -> dict[str, SpeculatorStats]:
        """Per-speculator counters (live objects: read them between steps)."""
        return self.chain.stats

    def speculator(self, name: str) -> Speculator:
        """A loaded speculator by name (ValueError naming the loaded ones otherwise)."""
        self.chain.check_types([name])
        return self.chain.speculators[name]

    def save_speculators(self) -> None:
        """Persist what speculators keep across processes (ngram_cache's dynamic table)."""
        self.chain.save()

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        t0 = time.perf_counter()
        step = self.scheduler.schedule(
            decode_tokens=1 + (self.config.spec_n_max if self.chain.names else 0))
        if step.empty:
            return []
        self._tuned_n_max = self._tuner_choice(step)
        drafts = self._propose(step.decode)
        t1 = time.perf_counter()
        chunks = [self._prefill_chunk(seq, n) for seq, n in step.prefill]
        chunks += [self._decode_chunk(seq, drafts.get(seq.seq_id)) for seq in step.decode]
        try:
            batch = build_forward_batch(self.cache, chunks, self.model.device,
                                        self._step_layers(step, chunks))
            batch.greedy_picks = self._picks_greedily(step)
            out = (self.state_rounds.forward(batch, chunks, set(drafts))
                   if self.state_rounds else self.model.forward(batch, self.cache))
        except Exception:  # a failed forward fails its sequences, never the engine
            log.exception("forward failed")
            seqs = [s for s, _ in step.prefill] + step.decode
            for seq in seqs:
                self._finish(seq, "error", f"forward failed for request {seq.request_id}; "
                             "details are in the server log")
            return [StepUpdate(s, [], True) for s in seqs]
        t2 = time.perf_counter()
        updates = self._commit(step, chunks, drafts, out, batch)
        if self.state_rounds:
            self.state_rounds.settle()
        t3 = time.perf_counter()
        self._account(step, batch.num_tokens, updates, t0, t1, t2, t3)
        return updates

    def _step_layers(self, step, chunks: list[SeqChunk]) -> tuple[int, ...]:
        """Target layers to capture in this step: those of the speculators that want rows of
        its chunks (`_feature_rows`), and those its requests asked for. Nothing when nobody
        needs them (no copies)."""
        seqs = [s for s, _ in step.prefill] + step.decode
        layers = set()
        for seq, chunk in zip(seqs, chunks):
            layers.update(seq.capture_layers)
            if seq.spec_types and chunk.num_feature_rows:
                layers.update(self.chain.hidden_layers(seq.spec_types))
        return tuple(sorted(layers))

    def _prefill_chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_computed
        if seq.scheduled_time is None:
            seq.scheduled_time = time.perf_counter()
        # Logits only at the prompt's end; a sequence recomputed after a preemption already has
        # its next token (the last of token_ids, fed by the next decode step).
        wants_logits = start + n == seq.num_prompt and seq.num_generated == 0
        return SeqChunk(seq.seq_id, start, seq.token_ids[start:start + n], int(wants_logits),
                        self._feature_rows(seq, n, max(0, seq.num_prompt - start - n)),
                        seq.num_prompt)

    def _decode_chunk(self, seq: Sequence, draft: Draft | None) -> SeqChunk:
        tokens = [seq.token_ids[-1]] + (draft.token_ids if draft is not None else [])
        return SeqChunk(seq.seq_id, seq.num_computed, tokens, len(tokens),
                        self._feature_rows(seq, len(tokens)))

    def _feature_rows(self, seq: Sequence, num_tokens: int, tokens_after: int = 0) -> int:
        """How many of a chunk's newest tokens need the target's features, when the step
        captures some: all for a request that asked for them, else those its speculators read
        (a long prompt's newest, `tokens_after` its tokens after the chunk; copying every row
        of a 1,500-token prompt at four layers cost ~1% of a rag run at c=8)."""
        if seq.capture_layers:
            return num_tokens
        return self.chain.feature_rows(seq.seq_id, seq.spec_types, num_tokens, tokens_after) \
            if seq.spec_types else 0

    def _propose(self, decoding: list[Sequence]) -> dict[int, Draft]:
        self.chain.round_catch_up_seconds = 0.0
        if not any(s.spec_types for s in decoding):  # plain decoding: no round to count
            return {}  # (the chain's bookkeeping of an empty round cost ~13 us a step)
        if self._tuned_n_max is None and self.chain.resting_round(
                [(s.seq_id, s.spec_types) for s in decoding
                 if s.spec_types and self._n_max(s.params) > 0]):
            return {}  # every speculator asked rests this round (drafter_ledger.py)
        requests, watched = [], []
        shadow = self._tuned_n_max == 0 and self.tuner.shadow_due(len(decoding))
        for seq in decoding:
            if not seq.spec_types:
                continue
            if self._n_max(seq.params) == 0:  # plain this step (the tuner's or the request's)
                if shadow and seq.params.spec.n_max is None:  # the tuner's: a shadow round
                    watched.append(DraftRequest(seq.seq_id, seq.token_ids,
                                                self._draft_params(seq, self.config.spec_n_max),
                                                num_prompt_tokens=seq.num_prompt))
                continue
            params = self._draft_params(seq)
            if params.n_max > 0:
                requests.append(DraftRequest(seq.seq_id, seq.token_ids, params, _draws(seq),
                                             seq.num_prompt))
        if watched:
            self._shadow(watched)
        if not requests:
            return {}
        try:
            return self.chain.draft(requests, self.cost.cost_per_token(len(decoding)),
                                    self.cost.seconds_per_token(len(decoding)))
        except Exception:  # a faulty speculator costs speed, never correctness or the engine
            log.exception("speculator failed; decoding this step without drafts")
            self.stats.num_speculator_errors += 1
            return {}

    def _shadow(self, requests: list[DraftRequest]) -> None:
        """The tuner decodes plain this step and asks for a shadow round (`SpecTuner.shadow_due`):
        the chain's model-free speculators still propose, unverified (`SpeculatorChain.shadow`),
        so that a later probe of drafting meets speculators that followed the text."""
        try:
            self.chain.shadow([r for r in requests if r.params.n_max > 0])
        except Exception:  # a faulty speculator costs speed, never correctness or the engine
            log.exception("speculator failed in a shadow round")
            self.stats.num_speculator_errors += 1

    def _draft_params(self, seq: Sequence, n_max: int | None = None) -> DraftParams:
        """The limits of `seq`'s draft this step (`n_max`: instead of the request's, the
        tuner's or the engine's limit), within what its context and max_tokens leave."""
        p = seq.params.spec
        n_max = self._n_max(seq.params) if n_max is None else n_max
        # The target adds one token after the draft: leave room for it in max_tokens and the
        # context. The KV reserved this step (kv_budget) holds positions up to the draft's end.
        room = min(seq.params.max_tokens - seq.num_generated - 1,
                   self.max_model_len - len(seq.token_ids) - 1, seq.kv_budget - len(seq.token_ids))
        n_max = max(0, min(n_max, room))
        n_min = self.config.spec_n_min if p.n_min is None else p.n_min
        p_min = self.config.spec_p_min if p.p_min is None else p.p_min
        return DraftParams(n_max=n_max, n_min=min(n_min, n_max), p_min=p_min)

    # ---- verification and commit -------------------------------------------------------------

    def _commit(self, step, chunks: list[SeqChunk], drafts: dict[int, Draft], out,
                batch) -> list[StepUpdate]:
        logits, cu_num_logits = out.logits, batch.cu_num_logits
        argmax = self._batched_argmax(batch, out)
        updates, committed = [], []
        features = StepFeatures(out.hidden_states) if out.hidden_states else None
        seqs = [s for s, _ in step.prefill] + step.decode
        for row, (seq, chunk) in enumerate(zip(seqs, chunks)):
            if seq.is_finished:  # aborted while the forward ran
                continue
            rows = slice(cu_num_logits[row], cu_num_logits[row + 1])
            is_prefill = chunk.start_pos < seq.num_prompt
            committed.append(CommittedTokens(seq.seq_id, chunk.start_pos, chunk.token_ids))
            if chunk.num_logits == 0:  # a prompt chunk that is not the last one
                self._advance_kv(seq, chunk.start_pos + len(chunk.token_ids))
                if not seq.is_prefilling:  # recomputed after a preemption: next token known
                    committed[-1].next_token_id = seq.token_ids[-1]
                self._keep_features(seq, committed[-1], features, len(chunk.token_ids),
                                    batch.cu_num_hidden[row:row + 2])
                continue
            draft = drafts.get(seq.seq_id)
            try:
                result = self._verify(seq, logits[rows], argmax[rows] if argmax is not None else None,
                                      draft)
                # Keep the K/V of the inputs the target agreed with; the rest is rolled back.
                num_kept = len(chunk.token_ids) if is_prefill else 1 + result.num_accepted
                self._advance_kv(seq, chunk.start_pos + num_kept)
                committed[-1].token_ids = chunk.token_ids[:num_kept]
                committed[-1].next_token_id = result.token_ids[-1]
                self._keep_features(seq, committed[-1], features, len(chunk.token_ids),
                                    batch.cu_num_hidden[row:row + 2])
                if not is_prefill:
                    seq.spec.record_step()
                if draft is not None:
                    seq.spec.record(draft.source, len(draft), result.num_accepted)
                    self.chain.accept(seq.seq_id, result.num_accepted)
                updates.append(self._append(seq, result.token_ids))
                if seq.capture_layers and seq.is_finished:
                    _trim_captured(seq)
            except Exception:  # sampling, drafting or detokenization: only this request fails
                updates.append(self._fail(seq))
        active = {s.seq_id for s in seqs if s.spec_types and not s.is_finished}
        try:
            self.chain.process([c for c in committed if c.seq_id in active])
        except Exception:  # a faulty speculator costs speed, never correctness or the engine
            log.exception("speculator failed to process committed tokens")
            self.stats.num_speculator_errors += 1
        return updates

    def _fail(self, seq: Sequence) -> StepUpdate:
        """End one request on an error raised while handling it (call inside `except`): its
        KV is freed, the others go on. The details go to the log, under its request id."""
        log.exception("request %s failed", seq.request_id)
        self._finish(seq, "error", f"request {seq.request_id} failed; details are in the "
                     "server log")
        return StepUpdate(seq, [], True)

    def _keep_features(self, seq: Sequence, committed: CommittedTokens,
                       features: StepFeatures | None, num_tokens: int,
                       captured: list[int]) -> None:
        """Hand the committed rows' target features to the speculators (through `committed`)
        and to the request if it asked for them; rejected rows are dropped here, with the KV.
        `captured`: [first, end) rows in `features` of the chunk's captured tokens, its
        newest (the committed ones are its oldest `num_tokens` or fewer)."""
        if features is None:
            return
        first_row, num_captured = captured[0], captured[1] - captured[0]
        committed.step_features, committed.feature_row = features, first_row
        committed.feature_skip = min(num_tokens - num_captured, len(committed.token_ids))
        rows = slice(first_row, first_row + committed.num_feature_rows)
        for i in seq.capture_layers:  # all of the chunk's rows were captured for these
            seq.captured[i].append(features.by_layer[i][rows].clone())

    @staticmethod
    def _picks_greedily(step) -> bool:
        """Whether some sequence of the step takes the argmax of its logits rows."""
        return any(_fast_greedy(s.params) for s, _ in step.prefill) or any(
            _fast_greedy(s.params) for s in step.decode)

    @staticmethod
    def _batched_argmax(batch, out) -> list[int] | None:
        """Argmax of every logits row with one host sync, when greedy rows need it: as the
        model's LM head found it while writing the logits (`ForwardOutput.argmax`), else in one
        op (native on the CPU: torch.argmax took 0.8 ms of a c=8 verification step's 20 rows)."""
        if not batch.greedy_picks or out.logits.shape[0] == 0:
            return None
        argmax = out.argmax if out.argmax is not None else row_argmax(out.logits)[0]
        return argmax.tolist()

    def _verify(self, seq: Sequence, logits: torch.Tensor, argmax: list[int] | None,
                draft: Draft | None) -> VerifyResult:
        # logits [k + 1, vocab]
        draft_ids = draft.token_ids if draft is not None else []
        params = seq.params
        if draft is not None and draft.forced_num_accepted is not None:
            return self._verify_synthetic(seq, logits, draft)
        if argmax is not None and _fast_greedy(params):
            return verify_greedy(argmax, draft_ids)
        if params.spec.verify == "rejection" and not params.is_greedy and draft_ids:
            p_tgt = seq.sampler.processed_probs(logits, seq.token_ids, draft_ids)
            return verify_rejection(p_tgt, draft.probs, draft_ids, seq.sampler.generator)
        return verify_match(seq.sampler, logits, seq.token_ids, draft_ids)

    def _verify_synthetic(self, seq: Sequence, logits: torch.Tensor, draft: Draft) -> VerifyResult:
        """Accept what the draft's (synthetic) drafter decided, not what the target says:
        speed measurement only."""
        n = draft.forced_num_accepted
        seq.synthetic = True
        next_id = int(logits[n].argmax())
        return VerifyResult(n, draft.token_ids[:n] + [next_id])

    def _advance_kv(self, seq: Sequence, new_length: int) -> None:
        seq.num_computed = new_length
        self.cache.set_length(seq.seq_id, new_length)
        self.cache.trim_reservation(seq.seq_id)

    def _append(self, seq: Sequence, new_ids: list[int]) -> StepUpdate:
        """Append verified tokens, stopping at the first stop condition among them. Tokens are
        detokenized one by one, so a stop string ends the output at the token completing it
        whatever number of tokens this step accepted."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        stop_ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            stop_ids |= self.eos_token_ids
        appended, pieces, reason = [], [], None
        for tok in new_ids:
            seq.token_ids.append(tok)
            appended.append(tok)
            piece, hit = seq.detokenizer.push(tok)
            pieces.append(piece)
            if hit is not None:
                seq.stop_text_len = hit.text_len
                reason = "stop"
            elif tok in stop_ids:
                reason = "stop"
            elif seq.num_generated >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if reason is not None:
            if seq.stop_text_len is None:
                pieces.append(seq.detokenizer.flush())
            self._finish(seq, reason)
        self.stats.num_generated_tokens += len(appended)
        return StepUpdate(seq, appended, seq.is_finished, "".join(pieces))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        if seq.spec_types:
            self.chain.end(seq.seq_id)

    def _account(self, step, num_tokens: int, updates: list[StepUpdate], t0, t1, t2, t3) -> None:
        s = self.stats
        num_new = sum(len(u.new_token_ids) for u in updates)
        s.num_steps += 1
        s.num_forward_tokens += num_tokens
        s.time_draft_s += t1 - t0
        s.time_forward_s += t2 - t1
        s.time_verify_s += t3 - t2
        self.chain.observe_step(t3 - t0, len(step.decode) if not step.prefill else 0)
        for seq, n in step.prefill:
            s.num_prompt_tokens += n
            seq.prefill_time_s += t3 - t0
        for seq in step.decode:
            seq.decode_step_time_s += t3 - t0
        if step.prefill:
            s.prefill_time_s += t3 - t0
        if step.decode and not step.prefill:
            s.num_decode_steps += 1
            s.decode_time_s += t3 - t0
            s.decode_tokens += num_new
            share = (t3 - t0) / len(step.decode)
            for seq in step.decode:
                seq.decode_only_s += share
            for u in updates:
                u.seq.decode_only_tokens += len(u.new_token_ids)
            self.cost.observe(len(step.decode), num_tokens, t3 - t1)
            if self._tuner_pulled:
                self.tuner.observe(len(step.decode), num_new,
                                   self._tuner_seconds(num_tokens, t3 - t0),
                                   catch_up_seconds=self.chain.round_catch_up_seconds,
                                   plain_step_s=self._plain_step_seconds(len(step.decode)))

    def _tuner_seconds(self, num_tokens: int, measured_s: float) -> float:
        """What the tuner scores a decode step by: its measured time (drafting, forward and
        verification). Tests substitute a cost model to make convergence deterministic."""
        return measured_s

    def _plain_step_seconds(self, num_decoding: int) -> float:
        """What a plain decode step of `num_decoding` sequences takes now, by the step-cost
        fit (0 before it has seen enough steps); the tuner reads a drafting incumbent's lead
        from it. Tests that substitute `_tuner_seconds` substitute this too."""
        if self.cost.num_observations < self.cost.min_observations:
            return 0.0
        return self.cost.seconds_per_token(num_decoding) * num_decoding

    # ---- outputs -----------------------------------------------------------------------------

    def output_text(self, seq: Sequence) -> str:
        """The output so far (all of it once finished), stop strings cut: kept incrementally,
        never decoded again from the start."""
        if seq.is_finished and seq.stop_text_len is None:
            seq.detokenizer.flush()
        return seq.detokenizer.text


def _resolve_kv_dtype(config: EngineConfig, head_dim: int) -> None:
    """A bfloat16 cache is in the AMX tiles' layout, which only the AMX-BF16 tiles and the
    AVX512_BF16 dot products attend fast, and only for some head sizes: chosen by auto, a model they do not fit keeps float16; asked for,
    it is refused by name on a CPU without them (the PyTorch fallback would run it ~50x slower)
    or for a head size they do not take."""
    if config.kv_dtype != "bfloat16":
        return
    try:
        check_tile_shape(config.block_size, head_dim)
    except ValueError:
        if not config.kv_dtype_auto:
            raise
        config.kv_dtype, config.block_size = "float16", 16
        return
    if torch.device(config.device).type == "cpu" and not tile_kv_cache():
        raise ValueError("kv_dtype bfloat16 keeps the KV cache in the AMX tiles' layout and needs "
                         "a CPU with AVX512_BF16 (lscpu flag avx512_bf16, beside avx512_vnni; "
                         "amx_bf16 runs it on tiles) and the native kernels; this one runs "
                         f"{kernel_path()}: use float16")


def _check_same_target(shared: EngineConfig, config: EngineConfig) -> None:
    """An engine sharing another's weights must ask for the same weights."""
    for field in ("model", "dtype", "device"):
        if getattr(shared, field) != getattr(config, field):
            raise ValueError(f"an engine sharing a loaded model cannot change its {field} "
                             f"({getattr(shared, field)!r} -> {getattr(config, field)!r})")


def _trim_captured(seq: Sequence) -> None:
    """A stop inside an accepted draft ends the output before tokens the target already
    read: their rows go too, so the captured features keep one row per token but the last
    (a stop token drafted and accepted mid-draft made them longer, when drafts ran past it)."""
    num_rows = sum(r.shape[0] for r in seq.captured[seq.capture_layers[0]])
    excess = num_rows - (len(seq.token_ids) - 1)
    if excess <= 0:
        return
    for i in seq.capture_layers:
        last = seq.captured[i][-1]  # the excess rows are all this step's
        seq.captured[i][-1] = last[:last.shape[0] - excess]


def _fast_greedy(params: SamplingParams) -> bool:
    return params.is_greedy and params.repetition_penalty == 1.0


def _draws(seq: Sequence) -> TargetDraws | None:
    """How the target will sample this sequence's next positions, for coupled drafts: only
    under sample-and-match (`_verify`: rejection sampling needs drafts drawn independently of
    the target's uniforms, and greedy has none)."""
    p = seq.params
    if p.is_greedy or p.spec.verify == "rejection":
        return None
    return TargetDraws(p, seq.sampler)
