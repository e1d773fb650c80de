"""Drafting from the target's own hidden states with a one-layer head (EAGLE-3, MTP).

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test") and DeepSeek-V3's multi-token prediction share one drafting scheme: a
head reads, for position p, the target's *features* at p (residual streams after some target
layers) together with the embedding of the token at p + 1, and predicts the token at p + 2.
Drafting further it feeds itself: its own output hidden at the previous draft position
replaces the target's features. The heads (`models/eagle3_head.py`, `models/mtp_head.py`)
expose the same per-step maths; this module owns the attention over a paged KV cache.

Terms used below:
- *head entry* p: the head's K/V at position p, computed from (feature f_p, token x_{p+1}).
- *catch-up*: entries the target's committed tokens make computable. After the target commits
  positions 0..N-1 and samples x_N, entries cached_len..N-1 are computed in one ragged forward
  over every drafting sequence; entry N-1 yields the first draft token.
- *draft entry*: entries N, N+1, ... from (the head's own hidden, previous draft token); they
  are dropped after the round (the KV length returns to N, as the target's rollback).

One head and one paged KV cache serve every sequence: each draft position is one batched head
forward over all sequences still drafting. Drafts are greedy by default (q one-hot; `probs`
None); with `temperature > 0` they are sampled and `probs` carries q over the target's
vocabulary, so rejection sampling stays lossless.
"""
from __future__ import annotations

import os
from abc import abstractmethod
from dataclasses import dataclass

import torch

from speculant.engine.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from speculant.engine.kv_cache import KV_DTYPES, CacheFullError, KVCache
from speculant.kernels import paged_attention
from speculant.speculators.base import (CommittedTokens, Draft, DraftBuilder, DraftRequest,
                                        Speculator, SpeculatorContext, TargetView)

REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(slots=True)
class FeatureDrafterConfig:
    """- head: the head to load (a folder, or a GGUF for MTP layers); empty = the head
      shipped for the target, if there is one.
    - kv_cache_tokens, kv_dtype, block_size: the head's paged KV cache (all sequences).
    - max_chunk_tokens: longest catch-up computed in one round (a long prompt is mirrored over
      several rounds; its sequence drafts once caught up).
    - temperature: 0 = greedy drafts; > 0 samples drafts and exposes their distribution.
    - seed: of draft sampling.
    """

    head: str = ""
    kv_cache_tokens: int = 32768
    kv_dtype: str = "float16"
    block_size: int = 16
    max_chunk_tokens: int = 1024
    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"feature drafter: kv_dtype must be one of {tuple(KV_DTYPES)}, got {self.kv_dtype!r}")
        for name in ("kv_cache_tokens", "block_size", "max_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"feature drafter: {name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ValueError(f"feature drafter: temperature must be in [0, 10], got {self.temperature}")


def shipped_head_path(target: TargetView, shipped: dict[str, str]) -> str:
    """The head shipped for this target (`shipped`: target file name -> folder under
    drafts/), or '' when none is."""
    name = shipped.get(os.path.basename(target.model_path))
    path = os.path.join(REPO_DIR, "drafts", name) if name else ""
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else ""


@dataclass(slots=True)
class _SeqState:
    cached_len: int = 0  # head entries 0..cached_len-1 are in the head's KV cache
    features: torch.Tensor | None = None  # [n, hidden] fused features of positions cached_len..


class FeatureDrafter(Speculator):
    """Base of the drafters that read target features; subclasses name the head to load."""

    config_class = FeatureDrafterConfig
    is_model_based = True
    provides_probs = True
    shipped_heads: dict[str, str] = {}  # target file name -> head folder under drafts/

    def __init__(self, ctx: SpeculatorContext, config: FeatureDrafterConfig, head, target: TargetView):
        """`head`: a head with the per-step API (`models/eagle3_head.py`) that fits `target`."""
        self.config = config
        self.head = head
        self.target = target
        self.hidden_layers = tuple(head.capture_layers)
        hc = head.config
        self.cache = KVCache(1, hc.num_kv_heads, hc.head_dim,
                             -(-config.kv_cache_tokens // config.block_size), config.block_size,
                             KV_DTYPES[config.kv_dtype], ctx.device)
        self.max_positions = min(ctx.max_seq_len, hc.max_position_embeddings)
        self.vocab_size = ctx.vocab_size
        self.eos_token_ids = frozenset(ctx.eos_token_ids)
        self._seqs: dict[int, _SeqState] = {}
        self._generator = torch.Generator().manual_seed(config.seed)
        # [draft_vocab] int64: the target token of each column of the head's logits
        self.draft_ids = torch.arange(hc.draft_vocab_size, device=head.d2t.device) + head.d2t
        self.num_draft_forwards = 0

    @classmethod
    def from_context(cls, ctx: SpeculatorContext, config: FeatureDrafterConfig | None):
        """Load the head named by the config, or the one shipped for the target."""
        config = config or FeatureDrafterConfig()
        if ctx.target is None:
            raise ValueError(f"{cls.name}: needs the target model's view (embedding, config)")
        path = config.head or shipped_head_path(ctx.target, cls.shipped_heads)
        if not path:
            raise ValueError(f"{cls.name}: no head shipped for {os.path.basename(ctx.target.model_path)}; "
                             f"give one with --spec-option {cls.name}.head=PATH")
        head = cls.load_head(path, ctx.target)
        config.head = path
        return cls(ctx, config, head.to(ctx.device).eval(), ctx.target)

    @classmethod
    @abstractmethod
    def load_head(cls, path: str, target: TargetView):
        """The head at `path`, checked against the target (ValueError names a mismatch)."""

    # ---- lifecycle ---------------------------------------------------------------------------

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id} already begun")
        self.cache.allocate(seq_id)
        self._seqs[seq_id] = _SeqState()

    def end(self, seq_id: int) -> None:
        if self._seqs.pop(seq_id, None) is not None:
            self.cache.free(seq_id)

    def accept(self, seq_id: int, num_accepted: int, is_other: bool) -> None:
        self._state(seq_id)  # draft entries are dropped at the end of every round already

    def _state(self, seq_id: int) -> _SeqState:
        if seq_id not in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id} was not begun")
        return self._seqs[seq_id]

    # ---- mirroring the target ----------------------------------------------------------------

    @torch.inference_mode()
    def process(self, batch: list[CommittedTokens]) -> None:
        """Keep the fused features of committed tokens until their head entries are computed
        (one `fc` call for the whole batch)."""
        batch = [c for c in batch if c.seq_id in self._seqs and c.token_ids]
        if not batch:
            return
        missing = [c.seq_id for c in batch if c.hidden_states is None]
        if missing:
            raise ValueError(f"{self.name}: no target features for sequence {missing[0]}")
        raw = torch.cat([torch.cat([c.hidden_states[i] for i in self.hidden_layers], dim=-1)
                         for c in batch])  # [sum n, n_feat * hidden]
        fused = self.head.fuse(raw)  # [sum n, hidden]
        row = 0
        for c in batch:
            self._append_features(self._seqs[c.seq_id], c.seq_id, c.start_pos,
                                  fused[row:row + len(c.token_ids)])
            row += len(c.token_ids)

    def _append_features(self, state: _SeqState, seq_id: int, start_pos: int,
                         rows: torch.Tensor) -> None:
        known = state.cached_len + (0 if state.features is None else state.features.shape[0])
        if start_pos > known:
            raise ValueError(f"{self.name}: sequence {seq_id} skipped positions {known}..{start_pos - 1}")
        if start_pos < state.cached_len:  # the target recomputed earlier positions
            self.cache.truncate(seq_id, start_pos)
            state.cached_len, state.features = start_pos, None
        kept = None if state.features is None else state.features[:start_pos - state.cached_len]
        state.features = rows.clone() if kept is None or kept.shape[0] == 0 else torch.cat([kept, rows])

    # ---- drafting ----------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        ready = [r for r in requests if self._can_draft(r)]
        grown: dict[int, DraftBuilder] = {r.seq_id: DraftBuilder() for r in ready}
        by_id = {r.seq_id: r for r in requests}
        # 1) catch-up entries (target features); the last one yields the first draft token
        chunks, inputs = [], []
        for r in ready:
            chunk, feats = self._catch_up(r)
            chunks.append(chunk)
            inputs.append(feats)
        # 2..n) one draft entry per sequence still drafting, fed with the head's own hidden
        is_catch_up = True
        while chunks:
            out = self._forward(chunks, torch.cat(inputs), is_catch_up)
            if out is None:
                break
            chunks, inputs = self._extend(chunks, out, by_id, grown)
            is_catch_up = False
        for r in ready:  # drop draft entries: the head's KV holds committed positions only
            state = self._seqs[r.seq_id]
            self.cache.truncate(r.seq_id, min(state.cached_len, self.cache.length(r.seq_id)))
        return {seq_id: g.to_draft() for seq_id, g in grown.items()
                if len(g.ids) >= max(1, by_id[seq_id].params.n_min)}

    def _can_draft(self, r: DraftRequest) -> bool:
        """The history's features must reach its last committed position, and the head's
        context and cache must hold the draft."""
        state = self._state(r.seq_id)
        num_feats = 0 if state.features is None else state.features.shape[0]
        committed = len(r.token_ids) - 1  # x_N (the last token) is not in the target's KV yet
        need = committed + r.params.n_max
        return (r.params.n_max > 0 and state.cached_len < committed <= state.cached_len + num_feats
                and need < self.max_positions and self.cache.can_grow(r.seq_id, need))

    def _catch_up(self, r: DraftRequest) -> tuple[SeqChunk, torch.Tensor]:
        """Entries cached_len..N-1: tokens x_{p+1}, features f_p. Longer than
        `max_chunk_tokens`: computed over several rounds, no draft until done."""
        state = self._seqs[r.seq_id]
        committed = len(r.token_ids) - 1
        start = state.cached_len
        end = min(committed, start + self.config.max_chunk_tokens)
        feats = state.features[:end - start]  # [n, hidden]
        state.features = state.features[end - start:]
        num_logits = 1 if end == committed else 0
        return SeqChunk(r.seq_id, start, list(r.token_ids[start + 1:end + 1]), num_logits), feats

    def _forward(self, chunks: list[SeqChunk], hidden: torch.Tensor, is_catch_up: bool):
        """One batched head forward. Returns (logits [R, draft_vocab], h_out [R, hidden]) for
        the rows that asked for logits, or None when the head's cache is full."""
        try:
            batch = build_forward_batch(self.cache, chunks, self.cache.k[0].device)
        except CacheFullError:
            return None
        self.num_draft_forwards += 1
        h_out = self._run_layer(batch, hidden)  # [T, hidden]
        for chunk in chunks:
            state = self._seqs[chunk.seq_id]
            end = chunk.start_pos + len(chunk.token_ids)
            if is_catch_up:  # entries of committed positions: kept across rounds
                state.cached_len = end
            self.cache.set_length(chunk.seq_id, end)
        rows = h_out.index_select(0, batch.logits_indices)
        return self.head.draft_logits(rows), rows

    def _run_layer(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The head's decoder layer over the ragged batch, its K/V written to the paged cache."""
        head = self.head
        embeds = head.embed(batch.token_ids)  # [T, hidden]
        q, k, v, residual = head.project_qkv(embeds, hidden.to(embeds.dtype))
        q = head.apply_rope(q, batch.positions)  # [T, H, hd]
        k = head.apply_rope(k, batch.positions)  # [T, KV, hd]
        k_cache, v_cache = self.cache.k[0], self.cache.v[0]
        flat_k = k_cache.view(-1, k.shape[1], k.shape[2])
        flat_v = v_cache.view(-1, v.shape[1], v.shape[2])
        flat_k[batch.slot_mapping] = k.to(k_cache.dtype)
        flat_v[batch.slot_mapping] = v.to(v_cache.dtype)
        attn = paged_attention(q.contiguous().float(), k_cache, v_cache, batch.block_tables,
                               batch.token_seq, batch.positions.to(torch.int32),
                               head.config.head_dim ** -0.5)  # [T, H, hd]
        return head.finish(attn.reshape(attn.shape[0], -1), residual)

    def _extend(self, chunks, out, by_id, grown):
        """Pick each sequence's next draft token; the ones still drafting get a draft entry."""
        logits, h_rows = out
        next_chunks, next_inputs, row = [], [], 0
        for chunk in chunks:
            if chunk.num_logits == 0:
                continue
            r, grow = by_id[chunk.seq_id], grown[chunk.seq_id]
            tok, prob, q = self._pick(logits[row])
            h = h_rows[row:row + 1]
            row += 1
            if prob < r.params.p_min:
                continue
            grow.add(tok, prob, q)
            pos = chunk.start_pos + len(chunk.token_ids)
            if len(grow.ids) < r.params.n_max and tok not in self.eos_token_ids \
                    and pos + 1 < self.max_positions and self.cache.can_grow(chunk.seq_id, pos + 1):
                next_chunks.append(SeqChunk(chunk.seq_id, pos, [tok], 1))
                next_inputs.append(h)
        return next_chunks, next_inputs

    def _pick(self, logits: torch.Tensor) -> tuple[int, float, torch.Tensor | None]:
        """logits [draft_vocab] -> (target token id, its draft probability, q over the
        target's vocabulary [vocab] when sampling)."""
        if self.config.temperature == 0.0:
            probs = torch.softmax(logits.float(), dim=-1)
            col = int(torch.argmax(logits))
            return int(self.draft_ids[col]), float(probs[col]), None
        probs = torch.softmax(logits.float() / self.config.temperature, dim=-1)
        col = int(torch.multinomial(probs, 1, generator=self._generator))
        tok = int(self.draft_ids[col])
        q = probs.new_zeros(self.vocab_size).index_copy_(0, self.draft_ids, probs)
        return tok, float(probs[col]), q


class TargetEmbedding:
    """The target's (packed) token embedding with the `.embed(ids)` the head calls."""

    __slots__ = ("embed",)

    def __init__(self, target: TargetView):
        self.embed = target.embed
