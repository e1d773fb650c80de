"""Draft-model speculation: a small model proposes, the target verifies (Leviathan et al. 2023).

One draft context serves every sequence (llama.cpp PR #22787/#22838): a single paged KV cache
of the draft model holds all sequences, and each draft position is ONE batched draft forward
over every sequence still drafting, so draft forwards per engine step equal draft positions,
not sequences x positions (`num_draft_forwards` counts them).

The draft cache mirrors the target's committed tokens lazily: a draft round first rolls each
sequence's draft cache back to the longest prefix it shares with the sequence's history (the
rejected draft tokens go), then evaluates the tokens the target committed since, together with
the last sampled token, in the same forward that yields the first draft position. This is the
`process` mirroring of the seeds done in one forward instead of two.

Drafts are greedy by default (the draft distribution q is then one-hot and `probs` is None);
with `temperature > 0` draft tokens are sampled from softmax(logits / T) and `probs` carries q,
so rejection sampling can use it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import torch

from speculant.engine.forward_batch import SeqChunk, build_forward_batch
from speculant.engine.kv_cache import KV_DTYPES, CacheFullError
from speculant.kernels.argmax import row_argmax
from speculant.speculators.base import (Draft, DraftBuilder, DraftRequest, Speculator, SpeculatorContext,
                                        TargetDraws, check_model_drafter_config,
                                        drafter_cache_kind)
from speculant.speculators.continuation import ContinuationRecord
from speculant.speculators.coupled import coupled_pick
from speculant.speculators.draft_vocab import head_token_ids, read_ranking
from speculant.speculators.feature_drafter import shipped_head_path
from speculant.speculators.ngram_match import common_prefix_len


# target file name -> the draft shipped for it under drafts/ (`--spec-type draft` with no model)
SHIPPED_DRAFTS = {"SmolLM2-135M-Instruct.Q4_1.gguf": "smollm2-135m-draft-4l"}


@dataclass(slots=True)
class DraftModelConfig:
    """- model: path of the draft model (GGUF or HF folder); `--draft-model` sets it. Empty =
      the draft shipped for the target (`SHIPPED_DRAFTS`), if there is one.
    - dtype: weights of the draft. auto keeps a GGUF's quantization and packs the float
      weights of an HF folder as Q8_0: a draft's precision changes only how often it is right,
      never the output, and Q8_0 runs the shipped 4-layer draft 1.6x (catching up) to 2x (one
      token) faster than F32 on AVX2.
    - kv_cache_tokens: capacity of the shared draft KV cache (all sequences).
    - kv_dtype: its element type, float16, float32 or bfloat16; auto (default): the target's
      (float16 under a float32 target).
    - max_chunk_tokens: longest catch-up evaluated in one draft forward (long prompts are
      mirrored over several rounds; the sequence drafts once it has caught up).
    - context_tokens: 0 = the draft reads a sequence's whole history; N > 0 = when more than N
      tokens are pending (a long prompt, or a sequence the chain or the tuner has not drafted
      for in a while) the draft context restarts on the last N tokens, positions from 0 (RoPE
      is relative). Bounds what catching up costs: a 2,800-token prompt cost the 4-layer draft
      ~1/7 of the target's prefill inside the first decode step.
    - temperature: 0 = greedy drafts; > 0 samples drafts and exposes their probabilities.
    - lm_head_tokens: 0 = the draft scores the whole vocabulary; N > 0 = only the N tokens the
      target generates most often (`draft_vocab.json` of the draft folder, see draft_vocab.py):
      a much cheaper draft step, at the price of never proposing the other tokens. -1 (default)
      = what the draft was trained for (`speculant_lm_head_tokens` in its config.json, written
      by `speculant distill --train-vocab N`), else 0.
    """

    model: str = ""
    dtype: str = "auto"
    kv_cache_tokens: int = 32768
    kv_dtype: str = "auto"
    block_size: int = 16
    max_chunk_tokens: int = 1024
    context_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    lm_head_tokens: int = -1

    def __post_init__(self) -> None:
        if self.lm_head_tokens < -1:
            raise ValueError(f"draft: lm_head_tokens must be >= 0 (or -1: as trained), "
                             f"got {self.lm_head_tokens}")
        if self.max_chunk_tokens < 1:
            raise ValueError(f"draft: max_chunk_tokens must be >= 1, got {self.max_chunk_tokens}")
        if self.context_tokens < 0:
            raise ValueError(f"draft: context_tokens must be >= 0 (0: whole history), "
                             f"got {self.context_tokens}")
        check_model_drafter_config("draft", self)


class DraftModelSpeculator(Speculator):
    name = "draft"
    config_class = DraftModelConfig
    is_model_based = True
    provides_probs = True

    def __init__(self, ctx: SpeculatorContext, config: DraftModelConfig | None = None,
                 model=None, tokenizer=None):
        """`model` (a `speculant.model.Model`) may be given directly; else it is loaded from
        `config.model`."""
        self.config = config = config or DraftModelConfig()
        if model is None:
            model, tokenizer = load_draft(config.model, config.dtype, ctx.device)
        self.model = model
        self.tokenizer = tokenizer
        self.max_positions = model.config.max_position_embeddings
        kv_dtype, block_size = drafter_cache_kind(config, ctx.kv_dtype, model.config.head_dim)
        self.cache = model.new_kv_cache(-(-config.kv_cache_tokens // block_size), block_size,
                                        KV_DTYPES[kv_dtype])
        self.vocab_size = min(ctx.vocab_size, model.config.vocab_size)
        self.eos_token_ids = frozenset(ctx.eos_token_ids)
        # [n] int64: the token of each column of the draft's logits; None = column i is token i
        self.head_ids: torch.Tensor | None = None
        num_head = config.lm_head_tokens if config.lm_head_tokens >= 0 else trained_head_tokens(config.model)
        if num_head and num_head < self.vocab_size:
            ranking = read_ranking(config.model)
            self.head_ids = head_token_ids(ranking, num_head, self.vocab_size, self.eos_token_ids)
            model.lm_head = model.lm_head.select_rows(self.head_ids)
        # coupled drafts walk the columns in the target's id order (`coupled.py`)
        self._couples = self.head_ids is None or bool((self.head_ids.diff() > 0).all())
        self._cached: dict[int, list[int]] = {}  # tokens whose K/V are in the draft cache
        self._offset: dict[int, int] = {}  # history index of the draft context's first token
        self._generator = torch.Generator().manual_seed(config.seed)
        self.num_draft_forwards = 0
        self.num_draft_rounds = 0
        self.continuation = ContinuationRecord()  # whether a further draft forward pays

    @classmethod
    def from_context(cls, ctx: SpeculatorContext, config: DraftModelConfig | None):
        """Load the draft named by the config (`--draft-model`) and check that its vocabulary
        is compatible with the target's."""
        from speculant.speculators.vocab_check import check_vocab_compatible

        config = config or DraftModelConfig()
        if not config.model:
            # the default model has a shipped draft (as `eagle3` finds its head)
            shipped = shipped_head_path(ctx.target, SHIPPED_DRAFTS) if ctx.target else ""
            if not shipped:
                target = os.path.basename(ctx.target.model_path) if ctx.target else "this target"
                raise ValueError("spec type 'draft' needs a draft model: --draft-model PATH "
                                 f"(or --spec-option draft.model=PATH); none is shipped for {target}")
            config = replace(config, model=shipped)
        model, tokenizer = load_draft(config.model, config.dtype, ctx.device)
        if ctx.tokenizer is not None:
            check_vocab_compatible(ctx.tokenizer, tokenizer)
        return cls(ctx, config, model=model, tokenizer=tokenizer)

    # ---- lifecycle ---------------------------------------------------------------------------

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._cached:
            raise ValueError(f"draft: sequence {seq_id} already begun")
        self.cache.allocate(seq_id)
        self._cached[seq_id] = []
        self._offset[seq_id] = 0

    def accept(self, seq_id: int, num_accepted: int, is_other: bool) -> None:
        self._state(seq_id)  # rollback happens at the next round, against the real history

    def end(self, seq_id: int) -> None:
        self._offset.pop(seq_id, None)
        if self._cached.pop(seq_id, None) is not None:
            self.cache.free(seq_id)

    def _state(self, seq_id: int) -> list[int]:
        if seq_id not in self._cached:
            raise ValueError(f"draft: sequence {seq_id} was not begun")
        return self._cached[seq_id]

    # ---- drafting ----------------------------------------------------------------------------

    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        self.num_draft_rounds += 1
        by_id = {r.seq_id: r for r in requests if self._catch_up_fits(r)}
        grown = {seq_id: DraftBuilder() for seq_id in by_id}
        self.further_rows = 0
        # 1) catch up with the target's committed tokens + the last token; 2..n) one token each.
        chunks = [self._catch_up_chunk(r) for r in by_id.values()]
        first = True
        while chunks:
            t0 = time.perf_counter()
            rows = self._forward(chunks)
            if rows is None:
                break
            if first:  # rows beyond the one that yields each first position: catching up
                self.first_seconds = time.perf_counter() - t0
                self.catch_up_seconds = self.first_seconds * _catch_up_share(chunks)
                first = False
            next_chunks = []
            for chunk, logits in zip(chunks, rows):
                if logits is None:
                    continue  # a long catch-up continues next round
                req, grow = by_id[chunk.seq_id], grown[chunk.seq_id]
                tok, prob, q = self._pick(logits, req.draws, len(grow.ids))
                if not grow.offer(tok, prob, q, req.params, self.continuation):
                    continue
                pos = chunk.start_pos + len(chunk.token_ids)
                if len(grow.ids) < req.params.n_max and tok not in self.eos_token_ids \
                        and self.cache.can_grow(req.seq_id, pos + 1) \
                        and self.continuation.worth(grow.need(req.params), req.params.further_cost):
                    next_chunks.append(SeqChunk(req.seq_id, pos, [tok], 1))
            chunks = next_chunks
            self.further_rows += len(chunks)
        return {seq_id: g.to_draft() for seq_id, g in grown.items()
                if len(g.ids) >= max(1, by_id[seq_id].params.n_min)}

    def _catch_up_fits(self, r: DraftRequest) -> bool:
        """Roll the draft cache back to what the history still agrees with (or restart it on
        the last context_tokens of the history); False when the sequence cannot be drafted for
        (context or draft cache exhausted)."""
        cached, offset = self._state(r.seq_id), self._offset[r.seq_id]
        history = r.token_ids
        keep = min(common_prefix_len(cached, history[offset:]), len(history) - offset - 1)
        window = min((w for w in (self.config.context_tokens, r.params.context_tokens) if w),
                     default=0)
        if window and len(history) - offset - keep > window:
            keep, self._offset[r.seq_id] = 0, len(history) - window
        if keep < len(cached):
            del cached[keep:]
            self.cache.truncate(r.seq_id, keep)
        need = len(history) - self._offset[r.seq_id] + r.params.n_max
        return r.params.n_max > 0 and need < self.max_positions and self.cache.can_grow(r.seq_id, need)

    def _catch_up_chunk(self, r: DraftRequest) -> SeqChunk:
        cached = self._cached[r.seq_id]
        pending = r.token_ids[self._offset[r.seq_id] + len(cached):]
        # the prompt's positions in the draft cache (which may start later in the history)
        num_prompt = max(0, r.num_prompt_tokens - self._offset[r.seq_id])
        if len(pending) > self.config.max_chunk_tokens:  # too long for one round: no logits yet
            return SeqChunk(r.seq_id, len(cached), pending[:self.config.max_chunk_tokens], 0,
                            num_prompt_tokens=num_prompt)
        return SeqChunk(r.seq_id, len(cached), pending, 1, num_prompt_tokens=num_prompt)

    def _forward(self, chunks: list[SeqChunk]) -> list[torch.Tensor | None] | None:
        """One batched draft forward; per chunk its logits row [vocab] (None if it asked for
        none). None when the draft cache cannot take the batch: the round ends without drafts."""
        try:
            batch = build_forward_batch(self.cache, chunks, self.model.device)
        except CacheFullError:
            return None
        self.num_draft_forwards += 1
        logits = self.model.forward(batch, self.cache).logits  # [num chunks with logits, vocab]
        rows, i = [], 0
        for chunk in chunks:
            cached = self._cached[chunk.seq_id]
            cached.extend(chunk.token_ids)
            self.cache.set_length(chunk.seq_id, len(cached))
            rows.append(logits[i] if chunk.num_logits else None)
            i += chunk.num_logits
        return rows

    def _pick(self, logits: torch.Tensor, draws: TargetDraws | None = None, position: int = 0
              ) -> tuple[int, float, torch.Tensor | None]:
        """logits [vocab_dft], or [n] over head_ids -> (token, its draft probability, q over
        the target's vocabulary [vocab] when sampling). Tokens beyond the target's vocabulary
        are never proposed. Where the target samples (`draws`), the token at draft `position`
        is drawn with its filters and uniform there (`coupled.py`)."""
        if self.head_ids is None:
            logits = logits[:self.vocab_size]
        if draws is not None and self._couples:
            col, prob = coupled_pick(logits, draws, position)
            return self._token(col), prob, None
        if self.config.temperature == 0.0:
            cols, probs = row_argmax(logits[None].float(), with_prob=True)  # [1], [1]
            return self._token(int(cols[0])), float(probs[0]), None
        probs = torch.softmax(logits / self.config.temperature, dim=-1)
        col = int(torch.multinomial(probs, 1, generator=self._generator))
        if self.head_ids is not None:  # q is zero outside the head's tokens
            probs = probs.new_zeros(self.vocab_size).index_copy_(0, self.head_ids, probs)
        return self._token(col), float(probs[self._token(col)]), probs

    def _token(self, col: int) -> int:
        return col if self.head_ids is None else int(self.head_ids[col])


def _catch_up_share(chunks: list[SeqChunk]) -> float:
    """Share of a draft forward's rows that only read history (all but one row of each
    sequence, or all of a long catch-up that yields no logits yet)."""
    rows = sum(len(c.token_ids) for c in chunks)
    return sum(len(c.token_ids) - c.num_logits for c in chunks) / rows if rows else 0.0


def trained_head_tokens(path: str) -> int:
    """The LM head size a distilled draft folder was trained for (0: the whole vocabulary)."""
    import json
    import os

    from speculant.training.distill import HEAD_TOKENS_KEY

    config = os.path.join(path, "config.json") if path and os.path.isdir(path) else ""
    if not config or not os.path.isfile(config):
        return 0
    with open(config) as f:
        return int(json.load(f).get(HEAD_TOKENS_KEY, 0))


def draft_dtype(path: str, dtype: str) -> str:
    """The weight format a draft loads in: `auto` is Q8_0 for float (HF folder) weights."""
    from speculant.models.loader import resolve_model

    return "q8_0" if dtype == "auto" and resolve_model(path).kind == "hf" else dtype


def load_draft(path: str, dtype: str, device: str):
    from speculant.models.loader import load_model
    from speculant.models.llama import Model
    from speculant.models.tokenizer import load_tokenizer

    if not path:
        raise ValueError("draft: no draft model given (use --draft-model PATH)")
    loaded = load_model(path, draft_dtype(path, dtype))
    return Model(loaded.config, loaded.weights, device), load_tokenizer(loaded.files)
