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

import gc
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from speculant.engine_config import EngineConfig
from speculant.forward_batch import SeqChunk, build_forward_batch
from speculant.kv_cache import KV_DTYPES
from speculant.loader import load_model
from speculant.model import Model
from speculant.sampler import Sampler
from speculant.sampling_params import SamplingParams
from speculant.scheduler import Scheduler
from speculant.sequence import Sequence, SeqStatus
from speculant.spec.base import CommittedTokens, Draft, DraftParams, DraftRequest, SpeculatorContext
from speculant.spec.chain import SpeculatorChain
from speculant.spec.factory import create_speculators
from speculant.spec.synthetic import synthetic_num_accepted
from speculant.step_cost import StepCostModel
from speculant.tokenizer import load_tokenizer
from speculant.verify import VerifyResult, verify_greedy, verify_match, verify_rejection

log = logging.getLogger("speculant")


@dataclass(slots=True)
class StepUpdate:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool


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
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.config = config = config or EngineConfig(**overrides)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config.model, config.dtype)
        self.model_config = loaded.config
        self.model = Model(loaded.config, loaded.weights, config.device)
        self.tokenizer = load_tokenizer(loaded.files)
        self.model_path = loaded.files.path
        self.max_model_len = min(config.max_model_len or loaded.config.max_position_embeddings,
                                 loaded.config.max_position_embeddings)
        self.cache = self.model.new_kv_cache(
            -(-config.kv_cache_tokens // config.block_size), config.block_size,
            KV_DTYPES[config.kv_dtype])
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_queue)
        self.eos_token_ids = {t for t in (self.tokenizer.eos_token_id,) if t is not None}
        self._spec_ctx = ctx = SpeculatorContext(vocab_size=loaded.config.vocab_size,
                                eos_token_ids=tuple(self.eos_token_ids),
                                max_seq_len=self.max_model_len, device=config.device)
        self.chain = SpeculatorChain(create_speculators(config, ctx, self))
        self.cost = StepCostModel()
        # Synthetic acceptance (benchmarks only) draws from its own generator: reproducible.
        self._synth_rng = torch.Generator().manual_seed(0)
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}
        # Everything loaded so far (torch, the model, tokenizer tables) lives as long as the
        # process: move it out of the cyclic GC's reach. Otherwise the GC's periodic full
        # collections, set off by the many small objects each step allocates, walk that whole
        # heap: ~10% of a decode step at context 1000 (measured).
        gc.freeze()

    # ---- requests ----------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate(prompt_ids, params, request_id)
        seq_id = next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}"
        seq = Sequence(seq_id=seq_id, request_id=request_id, prompt_ids=prompt_ids, params=params,
                       sampler=Sampler(params, self.model_config.vocab_size))
        seq.spec_types = self._spec_types(params)
        n_max = self._n_max(params)
        seq.kv_budget = min(len(prompt_ids) + params.max_tokens, self.max_model_len) + n_max + 1
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

    def _spec_types(self, params: SamplingParams) -> tuple[str, ...]:
        if not params.spec.enabled or not self.chain.names:
            return ()
        if params.spec.types is None:
            return tuple(self.chain.names)
        return self.chain.check_types(params.spec.types)

    def _n_max(self, params: SamplingParams) -> int:
        n = params.spec.n_max
        return self.config.spec_n_max if n is None else n

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
            self.chain = SpeculatorChain(create_speculators(self.config, self._spec_ctx, self))
            self.cost = StepCostModel()

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

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[StepUpdate]:
        t0 = time.perf_counter()
        step = self.scheduler.schedule(decode_tokens=1 + self.config.spec_n_max)
        if step.empty:
            return []
        drafts = self._propose(step.decode)
        t1 = time.perf_counter()
        chunks = [self._prefill_chunk(seq, n) for seq, n in step.prefill]
        chunks += [self._decode_chunk(seq, drafts.get(seq.seq_id)) for seq in step.decode]
        try:
            batch = build_forward_batch(self.cache, chunks, self.model.device)
            out = self.model.forward(batch, self.cache)
        except Exception as exc:  # a failed forward fails its sequences, never the engine
            log.exception("forward failed")
            seqs = [s for s, _ in step.prefill] + step.decode
            for seq in seqs:
                self._finish(seq, "error", f"forward failed: {exc}")
            return [StepUpdate(s, [], True) for s in seqs]
        t2 = time.perf_counter()
        updates = self._commit(step, chunks, drafts, out.logits, batch.cu_num_logits)
        t3 = time.perf_counter()
        self._account(step, batch.num_tokens, sum(len(u.new_token_ids) for u in updates),
                      t0, t1, t2, t3)
        return updates

    def _prefill_chunk(self, seq: Sequence, n: int) -> SeqChunk:
        start = seq.num_computed
        final = start + n == seq.num_prompt
        return SeqChunk(seq.seq_id, start, seq.prompt_ids[start:start + n], 1 if final else 0)

    def _decode_chunk(self, seq: Sequence, draft: Draft | None) -> SeqChunk:
        tokens = [seq.token_ids[-1]] + (draft.token_ids if draft is not None else [])
        return SeqChunk(seq.seq_id, seq.num_computed, tokens, len(tokens))

    def _propose(self, decoding: list[Sequence]) -> dict[int, Draft]:
        requests = []
        for seq in decoding:
            if not seq.spec_types:
                continue
            params = self._draft_params(seq)
            if params.n_max > 0:
                requests.append(DraftRequest(seq.seq_id, seq.token_ids, params))
        if not requests:
            return {}
        try:
            return self.chain.draft(requests, self.cost.cost_per_token(len(decoding)),
                                    self.cost.seconds_per_token(len(decoding)))
        except Exception:  # a faulty speculator costs speed, never correctness or the engine
            log.exception("speculator failed; decoding this step without drafts")
            self.stats.num_speculator_errors += 1
            return {}

    def _draft_params(self, seq: Sequence) -> DraftParams:
        p = seq.params.spec
        n_max = self._n_max(seq.params)
        # The target adds one token after the draft: leave room for it in max_tokens, the
        # context and the KV promise.
        room = min(seq.params.max_tokens - seq.num_generated,
                   self.max_model_len - len(seq.token_ids), seq.kv_budget - len(seq.token_ids)) - 1
        n_max = max(0, min(n_max, room))
        n_min = self.config.spec_n_min if p.n_min is None else p.n_min
        p_min = self.config.spec_p_min if p.p_min is None else p.p_min
        return DraftParams(n_max=n_max, n_min=min(n_min, n_max), p_min=p_min)

    # ---- verification and commit -------------------------------------------------------------

    def _commit(self, step, chunks: list[SeqChunk], drafts: dict[int, Draft],
                logits: torch.Tensor, cu_num_logits: list[int]) -> list[StepUpdate]:
        argmax = self._batched_argmax(step, logits)
        updates, committed = [], []
        seqs = [s for s, _ in step.prefill] + step.decode
        for row, (seq, chunk) in enumerate(zip(seqs, chunks)):
            if seq.is_finished:  # aborted while the forward ran
                continue
            rows = slice(cu_num_logits[row], cu_num_logits[row + 1])
            is_prefill = chunk.start_pos < seq.num_prompt
            committed.append(CommittedTokens(seq.seq_id, chunk.start_pos, chunk.token_ids))
            if chunk.num_logits == 0:  # a prompt chunk that is not the last one
                self._advance_kv(seq, chunk.start_pos + len(chunk.token_ids))
                continue
            draft = drafts.get(seq.seq_id)
            result = self._verify(seq, logits[rows], argmax[rows] if argmax is not None else None,
                                  draft)
            # Keep the K/V of the inputs the target agreed with; the rest is rolled back.
            num_kept = len(chunk.token_ids) if is_prefill else 1 + result.num_accepted
            self._advance_kv(seq, chunk.start_pos + num_kept)
            committed[-1].token_ids = chunk.token_ids[:num_kept]
            if not is_prefill:
                seq.spec.num_steps += 1
            if draft is not None:
                seq.spec.record(draft.source, len(draft), result.num_accepted)
                self.chain.accept(seq.seq_id, result.num_accepted)
            updates.append(self._append(seq, result.token_ids))
        active = {s.seq_id for s in seqs if s.spec_types and not s.is_finished}
        self.chain.process([c for c in committed if c.seq_id in active])
        return updates

    def _batched_argmax(self, step, logits: torch.Tensor) -> list[int] | None:
        """Argmax of every logits row in one op and one host sync, when greedy rows need it."""
        needs = any(_fast_greedy(s.params) for s, _ in step.prefill) or any(
            _fast_greedy(s.params) for s in step.decode)
        return logits.argmax(dim=-1).tolist() if needs and logits.shape[0] else None

    def _verify(self, seq: Sequence, logits: torch.Tensor, argmax: list[int] | None,
                draft: Draft | None) -> VerifyResult:
        # logits [k + 1, vocab]
        draft_ids = draft.token_ids if draft is not None else []
        params = seq.params
        if self.config.spec_synth_rates is not None and draft_ids:
            return self._verify_synthetic(seq, logits, draft_ids)
        if argmax is not None and _fast_greedy(params):
            return verify_greedy(argmax, draft_ids)
        if params.spec.verify == "rejection" and not params.is_greedy and draft_ids:
            p_tgt = seq.sampler.processed_probs(logits, seq.token_ids, draft_ids)
            return verify_rejection(p_tgt, draft.probs, draft_ids, seq.sampler.generator)
        return verify_match(seq.sampler, logits, seq.token_ids, draft_ids)

    def _verify_synthetic(self, seq: Sequence, logits: torch.Tensor, draft_ids: list[int]) -> VerifyResult:
        """Accept by the configured rates, not by the target: speed measurement only."""
        uniforms = torch.rand(len(draft_ids), generator=self._synth_rng).tolist()
        n = synthetic_num_accepted(self.config.spec_synth_rates, len(draft_ids), uniforms)
        seq.synthetic = True
        next_id = int(logits[n].argmax())
        return VerifyResult(n, draft_ids[:n] + [next_id])

    def _advance_kv(self, seq: Sequence, new_length: int) -> None:
        seq.num_computed = new_length
        self.cache.set_length(seq.seq_id, new_length)
        self.cache.trim_reservation(seq.seq_id)

    def _append(self, seq: Sequence, new_ids: list[int]) -> StepUpdate:
        """Append verified tokens, stopping at the first stop condition among them."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        appended = []
        reason = None
        num_before = seq.num_generated
        stop_ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            stop_ids |= self.eos_token_ids
        for tok in new_ids:
            seq.token_ids.append(tok)
            appended.append(tok)
            if tok in stop_ids:
                reason = "stop"
            elif seq.num_generated >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len:
                reason = "length"
            if reason:
                break
        if reason is None and seq.params.stop:
            reason = self._check_stop_strings(seq, len(appended))
            appended = seq.output_ids[num_before:]  # the stop may have trimmed trailing tokens
        if reason is not None:
            self._finish(seq, reason)
        self.stats.num_generated_tokens += len(appended)
        return StepUpdate(seq, appended, seq.is_finished)

    def _check_stop_strings(self, seq: Sequence, num_new: int) -> str | None:
        """Finish at the first stop string; the tokens after the one completing it go, so
        counts do not depend on how many tokens a step happened to accept."""
        gen = seq.output_ids
        text = self.tokenizer.decode(gen)
        longest = max(len(s) for s in seq.params.stop)
        # Only text that could contain a stop string ending in the new tokens is searched.
        prev_len = len(self.tokenizer.decode(gen[:-num_new])) if num_new else len(text)
        start = max(0, prev_len - longest + 1)
        hits = [(i, i + len(s)) for i, s in ((text.find(s, start), s) for s in seq.params.stop) if i >= 0]
        if not hits:
            return None
        hit, end = min(hits)
        keep = next(n for n in range(len(gen) - num_new + 1, len(gen) + 1)
                    if len(self.tokenizer.decode(gen[:n])) >= end)
        del seq.token_ids[seq.num_prompt + keep:]
        seq.stop_text_len = hit
        return "stop"

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        if seq.spec_types:
            self.chain.end(seq.seq_id)

    def _account(self, step, num_tokens: int, num_new: int, t0, t1, t2, t3) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_forward_tokens += num_tokens
        s.time_draft_s += t1 - t0
        s.time_forward_s += t2 - t1
        s.time_verify_s += t3 - t2
        for seq, n in step.prefill:
            s.num_prompt_tokens += n
            seq.prefill_time_s += t3 - t0
        if step.prefill:
            s.prefill_time_s += t3 - t0
        if step.decode and not step.prefill:
            s.num_decode_steps += 1
            s.decode_time_s += t3 - t0
            s.decode_tokens += num_new
            self.cost.observe(num_tokens, t3 - t1)

    # ---- outputs -----------------------------------------------------------------------------

    def output_text(self, seq: Sequence) -> str:
        text = self.tokenizer.decode(seq.output_ids)
        return text if seq.stop_text_len is None else text[:seq.stop_text_len]


def _fast_greedy(params: SamplingParams) -> bool:
    return params.is_greedy and params.repetition_penalty == 1.0
