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
- *committed entries*: those the target's committed tokens make computable. When the target
  commits positions up to N-1 and samples x_N, entries cached_len..N-1 are computed for every
  sequence asked to draft in one ragged head forward, and entry N-1's output hidden gives the
  round's first draft token (its LM head row). The forward is lazy: `process` only keeps the
  target's features, and `draft` computes the entries of the sequences it drafts for (as they
  pile up, `process` computes them once PENDING_LIMIT are waiting, for sequences the head
  drafted for lately). A sequence the chain does not ask this head to draft for (a model-free
  draft is better, or drafting does not pay) costs no head forward: measured, the eager
  per-step forward made `eagle3` 0.86-0.97x plain and the chain with it slower than without
  when the head rarely drafted; and computing the prompts and the piled-up entries of
  sequences never asked still cost 3% at c=8. Such a *silent* sequence (never asked, or not
  for SILENT_AFTER tokens) restarts on its newest HEAD_WINDOW entries when asked.
- *further forwards*: a draft token after the first costs a head forward; it runs only where
  the token could still join the draft and such forwards gained more than one costs
  (`continuation.py`; the chain measures that cost per row from `further_rows`).
- *window*: when more than MAX_WAITING entries wait (a prompt chunk that long: in decode the
  PENDING_LIMIT flush keeps fewer waiting), the head's cache for the sequence restarts on the
  newest HEAD_WINDOW of them: head slot 0 is then target position `base`. RoPE makes attention
  depend on position differences only, so the restarted head computes exactly what it computes
  for a sequence that starts at `base`; it loses the older entries, and the target's features
  still carry the whole context. A 1,500-token rag prompt then costs a 128-row head forward
  instead of a 1,500-row one.
- *draft entries*: N, N+1, ... from (the head's own hidden, the previous draft token); each
  further draft token is one batched forward; they are dropped after the round (the KV length
  returns to N, as the target's rollback).

One head and one paged KV cache serve every sequence: each draft position is one batched head
forward over all sequences still drafting. Drafts are greedy by default (q one-hot; `probs`
None); with `temperature > 0` they are sampled and `probs` carries q over the target's
vocabulary, so rejection sampling stays lossless.
"""
from __future__ import annotations

import json
import logging
import os
import time
from abc import abstractmethod
from dataclasses import dataclass, field

import torch

from speculant.engine.forward_batch import ForwardBatch, SeqChunk, build_forward_batch
from speculant.engine.kv_cache import KV_DTYPES, CacheFullError, KVCache
from speculant.kernels import paged_attention
from speculant.kernels.argmax import row_argmax
from speculant.kernels.huge_pages import move_to_huge_pages
from speculant.kernels.kv_layout import native_block_size, write_kv
from speculant.kernels.native import warm_in_background
from speculant.models.eagle3_head import run_layers
from speculant.models.eagle3_layer import further_layer_stack
from speculant.models.head_quant import packed_file
from speculant.models.packed_head import (load_head_blocks, pack_linears, packed_tensors,
                                          resolve_head_weights)
from speculant.speculators.base import (CommittedTokens, Draft, DraftBuilder, DraftRequest,
                                        Speculator, SpeculatorContext, StepFeatures,
                                        TargetDraws, TargetView, check_model_drafter_config,
                                        drafter_cache_kind)
from speculant.speculators.calibration import CalibrationPrior
from speculant.speculators.continuation import ContinuationRecord
from speculant.speculators.coupled import coupled_pick

log = logging.getLogger(__name__)
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(slots=True)
class FeatureDrafterConfig:
    """- head: the head to load (a folder, or a GGUF for MTP layers); empty = the head
      shipped for the target, if there is one.
    - kv_cache_tokens, kv_dtype, block_size: the head's paged KV cache (all sequences); kv_dtype
      auto (default) follows the target's cache (`base.drafter_cache_kind`).
    - temperature: 0 = greedy drafts; > 0 samples drafts and exposes their distribution.
    - seed: of draft sampling.
    - weights: how the head's matrices run: q4_1, q4_0 or q8_0 (packed, the target's native
      kernels; auto picks q4_1 on the CPU: `models/packed_head.py`), or float32 as loaded.
    """

    head: str = ""
    kv_cache_tokens: int = 32768
    kv_dtype: str = "auto"
    block_size: int = 16
    temperature: float = 0.0
    seed: int = 0
    weights: str = "auto"

    def __post_init__(self) -> None:
        check_model_drafter_config("feature drafter", self)
        resolve_head_weights(self.weights, "cpu")  # ValueError naming a bad value


def read_calibration_prior(head_path: str, packed: bool = False) -> CalibrationPrior | None:
    """The first-token calibration a head made by `speculant train-head` carries in its
    recipe.json (held-out answers), or None (no recipe, or an older one without it); with
    `packed`, that of the head as its shipped GPTQ blocks compute (`heldout_packed`) where the
    recipe has it. A recipe that carries a broken table is refused, naming the file."""
    recipe = os.path.join(head_path, "recipe.json") if os.path.isdir(head_path) else ""
    if not recipe or not os.path.isfile(recipe):
        return None
    try:
        with open(recipe) as f:
            figures = json.load(f)
        section = figures.get("heldout_packed") if packed else None
        table = (section or figures.get("heldout", {})).get("first_token_calibration")
        return None if table is None else CalibrationPrior.from_table(table)
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{recipe}: {e}") from e


def shipped_head_path(target: TargetView, shipped: dict[str, str]) -> str:
    """The head shipped for this target (`shipped`: target file name -> folder under
    drafts/), or '' when none is."""
    name = shipped.get(os.path.basename(target.model_path))
    path = os.path.join(REPO_DIR, "drafts", name) if name else ""
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else ""


# committed entries waiting for a forward; more are computed by `process` in one batch (a
# forward over 64 rows costs about as much as 3 one-row forwards on the CPU)
PENDING_LIMIT = 64
# more waiting entries than this (a long prompt chunk) restart the head's cache on the newest
# HEAD_WINDOW of them (128 rows cost ~15 ms on 2 AVX2 cores)
MAX_WAITING = 256
HEAD_WINDOW = 128
# A sequence the head was never asked to draft for, or not during the last SILENT_AFTER
# committed tokens, is silent: `process` keeps its features but computes no entries (at c=8,
# where the chain rarely asks the head, those forwards and the prompts' were 3% of the run).
# Asked (again), its head cache restarts on the newest HEAD_WINDOW waiting entries. (Restarted
# on 32, the head drafted worse after each silence: qa at c=1 accepted 1.33 tokens per step
# against 1.42, and was asked less, so fell silent more.)
SILENT_AFTER = PENDING_LIMIT
# A sequence the head was never asked for by its DORMANT_AFTER-th generated token is dormant:
# the target captures no features for it and `process` keeps nothing, until the chain asks the
# head for it (which wakes it: its window then starts at that step, so that first ask drafts
# nothing). Where the chain never asks the head (copy-heavy text, where n-gram drafts win) its
# features were still captured and kept at every step, ~0.5-1% of a summarization run at c=1
# with the head asked once in 20 prompts.
DORMANT_AFTER = 32
# ... and one asked before but not during its last DORMANT_SILENT committed tokens sleeps too:
# on rag at c=1 the head was asked 3 times in 20 prompts, and the sequences asked once were
# followed to their end, features captured and kept at 458 of 1,096 decode steps (~26 us a
# step of `process` alone). Twice SILENT_AFTER: a sequence the head drafts for sleeps only
# after a long stretch the n-gram drafts (a copy) held alone.
DORMANT_SILENT = 2 * SILENT_AFTER
# Waiting features are views of their steps' tensors (every sequence's rows of a step,
# `StepFeatures`); past this many a sequence joins its newest views into one tensor of its
# own, so it keeps at most this many steps' tensors alive, not those of its 256 waiting rows
MAX_FEATURE_PARTS = 16
# A head forward over n rows takes about FORWARD_FIXED_ROWS + n one-row times: reading the
# weights, not the rows, sets a small forward's time (64 rows ~ three 1-row forwards)
FORWARD_FIXED_ROWS = 30


@dataclass(slots=True)
class _StepRows:
    """Rows start..start+n-1 of a step's captured features (`StepFeatures`), not fused yet: a
    sequence the head is not asked for keeps these references and copies nothing."""

    step: StepFeatures
    start: int
    n: int


def _num_rows(part: torch.Tensor | _StepRows) -> int:
    return part.n if isinstance(part, _StepRows) else part.shape[0]


def _slice_part(part: torch.Tensor | _StepRows, lo: int, hi: int) -> torch.Tensor | _StepRows:
    if isinstance(part, _StepRows):
        return _StepRows(part.step, part.start + lo, hi - lo)
    return part[lo:hi]


def _join_views(views: list[_StepRows], layers: tuple[int, ...]) -> torch.Tensor:
    """[sum n, len(layers) * hidden] the views' rows as one tensor of their own: per layer
    the rows of every step, then the layers side by side (len(layers) + 1 copies, however
    many steps; no step's whole batch is fused for it; one copy for one view, the common case
    at c=1, where the per-layer joins had been ~3% of a drafting round)."""
    if len(views) == 1:
        v = views[0]
        return torch.cat([v.step.by_layer[i][v.start:v.start + v.n] for i in layers], dim=-1)
    per_layer = [torch.cat([v.step.by_layer[i][v.start:v.start + v.n] for v in views])
                 for i in layers]
    return torch.cat(per_layer, dim=-1)


@dataclass(slots=True)
class _SeqState:
    base: int = 0  # the target position of head slot 0 (> 0 after a window restart)
    cached_len: int = 0  # head slots 0..cached_len-1 are in the head's KV cache
    # the target's captured features of slots cached_len..cached_len+n-1 at `layers`, as row
    # blocks joined only when read (joined at every step, the waiting rows were copied over
    # and over: O(n^2) per PENDING_LIMIT tokens), and the committed tokens at those slots. The
    # last `num_views` blocks are references to their steps' rows (`_StepRows`, fused only
    # when read: fusing each step's features for a sequence the head was not asked for was
    # the largest part of its cost per step, cProfile on rag at c=1: torch.cat 58 of ~145 us),
    # the others [n_i, n_feat * hidden] tensors of this sequence's own.
    layers: tuple[int, ...] = ()
    feature_parts: list = field(default_factory=list)
    num_views: int = 0
    tokens: list[int] = field(default_factory=list)
    next_token: int | None = None  # the token after them, when the target sampled it
    # the history length the head was last asked to draft after (None: never asked)
    asked_len: int | None = None
    # [1, hidden] output of the newest committed entry: the source of the next round's first
    # draft token; None when it is not computed
    last: torch.Tensor | None = None
    prompt_len: int = 0
    dormant: bool = False  # DORMANT_AFTER: no features kept, none wanted

    def features(self) -> torch.Tensor:
        """[n, n_feat * hidden] the waiting entries' features, as one tensor."""
        parts = self.feature_parts
        if len(parts) > 1 or isinstance(parts[0], _StepRows):
            own = parts[:len(parts) - self.num_views]
            if self.num_views:
                own.append(_join_views(parts[len(parts) - self.num_views:], self.layers))
            self.feature_parts, self.num_views = [own[0] if len(own) == 1 else torch.cat(own)], 0
        return self.feature_parts[0]

    def add_features(self, step: StepFeatures, start: int, n: int) -> None:
        """Append a reference to rows start..start+n-1 of a step's features; past
        MAX_FEATURE_PARTS references, join them into a block of the sequence's own (each row
        copied once), releasing the steps' tensors."""
        self.feature_parts.append(_StepRows(step, start, n))
        self.num_views += 1
        if self.num_views > MAX_FEATURE_PARTS:
            views = self.feature_parts[-self.num_views:]
            self.feature_parts[-self.num_views:] = [_join_views(views, self.layers)]
            self.num_views = 0

    def drop_features(self, start: int, end: int | None = None) -> None:
        """Keep the waiting features [start:end] only (no copy: blocks are sliced, references
        narrowed)."""
        kept, pos = [], 0
        for part in self.feature_parts:
            n = _num_rows(part)
            lo, hi = max(start, pos), pos + n if end is None else min(end, pos + n)
            if hi > lo:
                kept.append(_slice_part(part, lo - pos, hi - pos))
            pos += n
        self.feature_parts = kept
        self.num_views = 0
        for part in reversed(kept):
            if not isinstance(part, _StepRows):
                break
            self.num_views += 1

    def own_features(self) -> None:
        """Copy the waiting rows into a tensor of the sequence's own, so that no step's (or
        older block's) whole tensor stays alive for a few of its rows."""
        if self.feature_parts:
            self.feature_parts = [self.features().clone()]

    def clear_features(self) -> None:
        self.feature_parts, self.num_views = [], 0


class FeatureDrafter(Speculator):
    """Base of the drafters that read target features; subclasses name the head to load."""

    config_class = FeatureDrafterConfig
    is_model_based = True
    provides_probs = True
    shipped_heads: dict[str, str] = {}  # target file name -> head folder under drafts/
    packed_blocks: str = ""  # the file of GPTQ blocks its packed linears came from, if any

    def __init__(self, ctx: SpeculatorContext, config: FeatureDrafterConfig, head, target: TargetView):
        """`head`: a head with the per-step API (`models/eagle3_head.py`) that fits `target`."""
        self.config = config
        self.head = head
        self.target = target
        self.hidden_layers = tuple(head.capture_layers)
        hc = head.config
        kv_dtype, block_size = drafter_cache_kind(config, ctx.kv_dtype, hc.head_dim)
        self.num_layers = getattr(head, "num_layers", 1)  # decoder layers: one KV cache each
        self.cache = KVCache(self.num_layers, hc.num_kv_heads, hc.head_dim,
                             -(-config.kv_cache_tokens // block_size), block_size,
                             KV_DTYPES[kv_dtype], ctx.device)
        self.max_positions = min(ctx.max_seq_len, hc.max_position_embeddings)
        self.vocab_size = ctx.vocab_size
        self.eos_token_ids = frozenset(ctx.eos_token_ids)
        self._seqs: dict[int, _SeqState] = {}
        self._generator = torch.Generator().manual_seed(config.seed)
        # [draft_vocab] int64: the target token of each column of the head's logits
        self.draft_ids = torch.arange(hc.draft_vocab_size, device=head.d2t.device) + head.d2t
        self._draft_id_list = self.draft_ids.tolist()  # the same, read per picked token
        # coupled drafts walk the columns in the target's id order (`coupled.py`)
        self._couples = all(a < b for a, b in zip(self._draft_id_list, self._draft_id_list[1:]))
        self.num_draft_forwards = 0
        self.continuation = ContinuationRecord()  # whether a further draft forward pays
        # the head's layer on the target's fused kernels, when the head offers one for its
        # (packed) weights; else the reference maths op by op
        packed = getattr(head, "packed_layer", None)
        self.packed_layer = packed() if packed is not None else None
        # a deeper head's further layers on the target's native decoder stack (None: op by op)
        self.further_stack = further_layer_stack(head) \
            if self.packed_layer is not None and self.num_layers > 1 \
            and native_block_size(self.cache.block_size) else None
        # its packed weights on 2 MB pages, as the target's (kernels/huge_pages.py)
        move_to_huge_pages(packed_tensors(head) + (
            [t for t in self.packed_layer.weights if isinstance(t, torch.Tensor)]
            if self.packed_layer is not None else []))
        self.warm_weights = self._own_layer_weights()

    def _own_layer_weights(self) -> list[torch.Tensor]:
        """The tensors the packed layer's call reads that are the head's own, in the order it
        reads them (the target's token table and LM head, which it may share, are not: the
        target reads those itself). What a drafting round warms (`warm_in_background`)."""
        if self.packed_layer is None:
            return []
        target = {t.data_ptr() for m in (self.target.embed_table, self.target.lm_head)
                  for t in (getattr(m, "data", None), getattr(m, "scales", None),
                            getattr(m, "mins", None)) if isinstance(t, torch.Tensor)}
        return [t for t in self.packed_layer.weights
                if isinstance(t, torch.Tensor) and t.is_cpu and t.is_contiguous()
                and t.data_ptr() not in target]

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
        head = cls.load_head(path, ctx.target).to(ctx.device).eval()
        config.head = path
        qtype = resolve_head_weights(config.weights, ctx.device)
        blocks = load_head_blocks(head, path, qtype) if qtype != "float32" else {}
        if qtype != "float32":
            pack_linears(head, qtype, blocks)
        prior = read_calibration_prior(path, packed=bool(blocks))
        drafter = cls(ctx, config, head, ctx.target)
        drafter.calibration_prior = prior
        drafter.packed_blocks = os.path.basename(packed_file(path, qtype)) if blocks else ""
        log.info("%s head %s: %s weights%s", cls.name, path, qtype,
                 f" (GPTQ blocks from {drafter.packed_blocks})" if blocks else "")
        return drafter

    @classmethod
    @abstractmethod
    def load_head(cls, path: str, target: TargetView):
        """The head at `path`, checked against the target (ValueError names a mismatch)."""

    # ---- lifecycle ---------------------------------------------------------------------------

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._seqs:
            raise ValueError(f"{self.name}: sequence {seq_id} already begun")
        self.cache.allocate(seq_id)
        self._seqs[seq_id] = _SeqState(layers=self.hidden_layers, prompt_len=len(prompt_ids))

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

    def process(self, batch: list[CommittedTokens]) -> None:
        """Keep the committed tokens' target features (entry p needs the feature f_p and the
        token x_{p+1}; the newest entry uses the token the target just sampled,
        `next_token_id`); past MAX_WAITING waiting entries, restart the sequence's head
        window on the newest HEAD_WINDOW; compute the entries of sequences with PENDING_LIMIT
        or more waiting, in one batched head forward (as the seeds mirror target batches into
        the draft context)."""
        batch = [c for c in batch if c.seq_id in self._seqs and c.token_ids
                 and not self._seqs[c.seq_id].dormant]
        for c in [c for c in batch if c.step_features is None and c.next_token_id is None]:
            self._skip_unread(c)  # a prompt chunk before the window (`feature_rows`)
        batch = [c for c in batch if c.step_features is not None or c.next_token_id is not None]
        missing = [c.seq_id for c in batch if c.step_features is None]
        if missing:
            raise ValueError(f"{self.name}: no target features for sequence {missing[0]}")
        chunks = []
        for c in batch:
            state = self._seqs[c.seq_id]
            self._append(state, c)
            if self._falls_dormant(state):
                self._sleep(c.seq_id, state)
                continue
            if len(state.tokens) > MAX_WAITING:
                self._restart_window(c.seq_id, state)
            if len(state.tokens) >= PENDING_LIMIT and not self._is_silent(state):
                chunk = self._waiting_chunk(c.seq_id, state)
                if chunk is not None:
                    chunks.append(chunk)
        if chunks:
            with torch.inference_mode():
                self._compute_committed(chunks)

    def feature_rows(self, seq_id: int, num_tokens: int, tokens_after: int = 0) -> int:
        """No row of a dormant sequence (DORMANT_AFTER); of a chunk longer than MAX_WAITING the
        newest HEAD_WINDOW: it restarts the head's window there (`process`), the older rows'
        features would never be read. Of a prompt chunk with `tokens_after` prompt tokens
        after it, those among the prompt's newest HEAD_WINDOW: a long prompt restarts the
        window there anyway (at c=8 a prompt goes in 32-token chunks beside the decoding
        sequences; capturing, keeping and re-joining all of a 900-token summarization
        prompt's rows for a head that was then never asked was ~1% of the run)."""
        state = self._seqs.get(seq_id)
        if state is not None and state.dormant:
            return 0
        if tokens_after > 0:
            return max(0, min(num_tokens, HEAD_WINDOW - tokens_after))
        return num_tokens if num_tokens <= MAX_WAITING else HEAD_WINDOW

    def _check_no_gap(self, c: CommittedTokens, state: _SeqState) -> None:
        known = state.base + state.cached_len + len(state.tokens)  # positions seen
        if c.start_pos > known:
            raise ValueError(f"{self.name}: sequence {c.seq_id} skipped positions "
                             f"{known}..{c.start_pos - 1}")

    def _skip_unread(self, c: CommittedTokens) -> None:
        """A prompt chunk none of whose rows the head reads came without features (the step
        captured none): the head's window restarts after it, as for a chunk whose rows all
        had `feature_skip`."""
        state = self._seqs[c.seq_id]
        self._check_no_gap(c, state)
        self.cache.truncate(c.seq_id, 0)
        state.base, state.cached_len, state.tokens = c.start_pos + len(c.token_ids), 0, []
        state.clear_features()
        state.next_token, state.last = None, None

    def _append(self, state: _SeqState, c: CommittedTokens) -> None:
        # c's features are kept as a reference to its rows of the step's features (joined with
        # the sequence's other waiting rows when read or piling up)
        self._check_no_gap(c, state)
        start = c.start_pos - state.base  # head slot of c's first token
        # restart the window where c's features start when the target recomputed positions
        # before it, or captured only c's newest tokens (`feature_rows`)
        if start < 0 or c.feature_skip:
            self.cache.truncate(c.seq_id, 0)
            state.base, state.cached_len, state.tokens = c.start_pos + c.feature_skip, 0, []
            state.clear_features()
            start = 0
        elif start < state.cached_len:  # the target recomputed earlier positions
            self.cache.truncate(c.seq_id, start)
            state.cached_len, state.tokens = start, []
            state.clear_features()
        keep = start - state.cached_len
        if keep < len(state.tokens):
            state.drop_features(0, keep)
            del state.tokens[keep:]
        state.add_features(c.step_features, c.feature_row, c.num_feature_rows)
        state.tokens.extend(c.token_ids[c.feature_skip:])
        state.next_token = c.next_token_id
        state.last = None  # the newest entry moved on: computed again when it is needed

    def _falls_dormant(self, state: _SeqState) -> bool:
        committed = state.base + state.cached_len + len(state.tokens)
        if state.asked_len is None:
            return committed - state.prompt_len > DORMANT_AFTER
        return committed - state.asked_len > DORMANT_SILENT

    def _sleep(self, seq_id: int, state: _SeqState) -> None:
        """Drop the sequence's head cache and waiting features: it keeps none while dormant."""
        self.cache.truncate(seq_id, 0)
        state.cached_len, state.tokens, state.last, state.next_token = 0, [], None, None
        state.clear_features()
        state.dormant = True

    def follows(self, seq_id: int) -> bool:
        state = self._seqs.get(seq_id)
        return state is not None and not state.dormant

    def rest(self, seq_id: int) -> None:
        """Dormant until woken: no features kept, none captured (`feature_rows`)."""
        state = self._seqs.get(seq_id)
        if state is not None and not state.dormant:
            self._sleep(seq_id, state)

    def wake(self, seq_id: int, history_len: int) -> None:
        """Keep features again from the step the target runs next (the window starts there,
        as a dormant sequence's does when asked)."""
        state = self._seqs.get(seq_id)
        if state is not None and state.dormant:
            state.dormant = False
            state.base = history_len - 1  # the positions the target's KV holds
            state.asked_len = history_len  # followed from here, as if asked (DORMANT_SILENT)

    def _is_silent(self, state: _SeqState) -> bool:
        return state.asked_len is None or \
            state.base + state.cached_len + len(state.tokens) - state.asked_len > SILENT_AFTER

    def _restart_window(self, seq_id: int, state: _SeqState) -> None:
        """Drop the head's cached entries and all but the newest HEAD_WINDOW waiting ones: the
        next draft computes HEAD_WINDOW entries, not every position since the last one."""
        dropped = len(state.tokens) - HEAD_WINDOW
        self.cache.truncate(seq_id, 0)
        state.base += state.cached_len + dropped
        state.cached_len = 0
        state.drop_features(dropped)
        state.own_features()  # not the whole prompt chunk's features for its last rows
        state.tokens = state.tokens[dropped:]

    def _waiting_chunk(self, seq_id: int, state: _SeqState) -> SeqChunk | None:
        """The entries waiting for a forward whose next token is known: entry p reads x_{p+1},
        the newest one the token the target sampled (`next_token`; a prompt chunk that is not
        the last one has none: its last entry waits for the next chunk) and asks for its
        output. None when no entry can be computed."""
        if not state.tokens:  # every entry computed (its newest output is `last`)
            return None
        next_ids = state.tokens[1:] + ([state.next_token] if state.next_token is not None else [])
        if not next_ids or not self.cache.can_grow(seq_id, state.cached_len + len(next_ids)):
            return None
        return SeqChunk(seq_id, state.cached_len, next_ids, int(state.next_token is not None))

    def _pending_chunk(self, r: DraftRequest) -> SeqChunk | None:
        """Before drafting for `r`: its waiting entries, when they reach its last committed
        position and the token after it is `r`'s last token."""
        state = self._state(r.seq_id)
        if state.base + state.cached_len + len(state.tokens) != len(r.token_ids) - 1 \
                or state.next_token != r.token_ids[-1]:
            return None
        return self._waiting_chunk(r.seq_id, state)

    def _compute_committed(self, chunks: list[SeqChunk], with_logits: bool = False
                           ) -> dict[int, tuple]:
        """One batched forward over the committed entries of `chunks`, fed their fused
        features; a chunk asking for logits keeps its newest entry's output (`last`). With
        `with_logits`, that entry's draft logits too, computed in the same call (returned by
        sequence: ([1, draft_vocab], its greedy pick (col, prob) or None)): the first draft
        token's, which drafting reads next (a separate LM-head call after the forward took
        ~0.3 ms of a ~2.4 ms draft at c=1)."""
        if not chunks:
            return {}
        raw = torch.cat([self._seqs[c.seq_id].features()[:len(c.token_ids)] for c in chunks])
        out = self._forward(chunks, self._layer_hidden(raw), with_logits=with_logits)
        if out is None:  # the head's cache is full: these sequences draft nothing for now
            for chunk in chunks:
                self._seqs[chunk.seq_id].last = None
            return {}
        logits, h_rows, picks = out if with_logits else (None, out, None)
        first_logits, row = {}, 0
        for chunk in chunks:
            state = self._seqs[chunk.seq_id]
            state.cached_len = chunk.start_pos + len(chunk.token_ids)
            state.drop_features(len(chunk.token_ids))
            state.tokens = state.tokens[len(chunk.token_ids):]
            state.last = None
            if chunk.num_logits:
                state.last = h_rows[row:row + 1]
                if logits is not None:
                    first_logits[chunk.seq_id] = (logits[row:row + 1],
                                                  None if picks is None else picks[row])
                row += 1
        return first_logits

    def _layer_hidden(self, raw: torch.Tensor) -> torch.Tensor:
        """The committed entries' hidden input from their captured features `raw` [T, n_feat *
        d]: as they are when the native layer fuses them itself (`fc` in its call), else fused
        here ([T, d])."""
        layer = self.packed_layer
        if layer is not None and layer.fc is not None \
                and raw.shape[-1] != layer.input_norm.shape[0]:
            return raw
        return self.head.fuse(raw)

    # ---- drafting ----------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        """Draft token 1 comes from the newest committed entry (computed here with the other
        waiting entries, or kept by `process`); each further token is one batched forward of
        draft entries fed with the head's own hidden."""
        t0, self.further_rows = time.perf_counter(), 0
        # The target's forward has flushed the head's weights from the caches, and reading
        # them back is what a head call costs (the same call repeated: 620 / 343 / 252 us):
        # the pool's idle worker reads them while this thread prepares the round. Rounds
        # ~15% shorter on mt_bench at c=1 (AMD EPYC Zen 4, docs/heads.md).
        warm_in_background(self.warm_weights)
        revived = {r.seq_id for r in requests if self.revival_rows(r.seq_id)}
        for r in requests:
            self._resume(r)
        pending = [c for c in (self._pending_chunk(r) for r in requests if r.params.n_max > 0)
                   if c is not None]
        first_logits = self._compute_committed(pending, with_logits=True)
        self._share_catch_up(time.perf_counter() - t0, pending, revived)
        ready = [r for r in requests if self._can_draft(r)]
        grown: dict[int, DraftBuilder] = {r.seq_id: DraftBuilder() for r in ready}
        by_id = {r.seq_id: r for r in requests}
        chunks = [SeqChunk(r.seq_id, self._seqs[r.seq_id].cached_len - 1, [r.token_ids[-1]], 1)
                  for r in ready]
        out = None
        if ready:
            out = self._first_logits(ready, first_logits)
        self.first_seconds = time.perf_counter() - t0
        while chunks and out is not None:
            chunks, inputs = self._extend(chunks, out, by_id, grown)
            self.further_rows += len(chunks)
            out = self._forward(chunks, torch.cat(inputs)) if chunks else None
        for r in ready:  # drop draft entries: the head's KV holds committed positions only
            self.cache.truncate(r.seq_id, self._seqs[r.seq_id].cached_len)
        return {seq_id: g.to_draft() for seq_id, g in grown.items()
                if len(g.ids) >= max(1, by_id[seq_id].params.n_min)}

    def _first_logits(self, ready: list[DraftRequest], computed: dict[int, tuple]):
        """(logits [S, draft_vocab], h [S, hidden], greedy picks or None) of the `ready`
        sequences' newest committed entries: their logits (and picks) from the catch-up forward
        (`computed`), the LM head run now for the entries computed before this round
        (`process`, PENDING_LIMIT)."""
        last = torch.cat([self._seqs[r.seq_id].last for r in ready])  # [S, hidden]
        if all(r.seq_id in computed for r in ready):
            picks = [computed[r.seq_id][1] for r in ready]
            return (torch.cat([computed[r.seq_id][0] for r in ready]), last,
                    None if any(p is None for p in picks) else picks)
        return self._draft_logits(last), last, None

    def revival_rows(self, seq_id: int) -> int:
        """A silent sequence (never asked, or not lately) restarts on its newest HEAD_WINDOW
        waiting entries when asked: rows a followed sequence would not need. A dormant one
        counts a whole window: asking it wakes it, and it drafts only once it has read that
        many steps again (priced as a silent sequence with a full window, the chain asks it
        as rarely as before it slept)."""
        state = self._state(seq_id)
        if state.dormant:
            return HEAD_WINDOW
        if not self._is_silent(state):
            return 0
        return min(len(state.tokens), HEAD_WINDOW)

    def _share_catch_up(self, seconds: float, pending: list[SeqChunk], revived: set[int]) -> None:
        """Split the catch-up forward's `seconds` by rows (a forward over n rows costs about
        FORWARD_FIXED_ROWS + n one-row times). Sunk: the rows beyond each followed sequence's
        newest, which its batched forwards in `process` compute anyway once PENDING_LIMIT
        wait. Catch-up: a revived sequence's (`revival_rows`), a cost of asking it. The rest
        (the weights read for this forward, each sequence's newest row, which yields its first
        draft token) is the price of the call. (Priced with every row, a head asked rarely
        looked dear and was asked rarer: math_reasoning at c=1 fell from 1.17x to 0.98x plain;
        priced with none, at c=8 on mt_bench the head was asked where its drafts cost more
        than they saved.)"""
        num_rows = sum(len(c.token_ids) for c in pending)
        old_rows = {c.seq_id: len(c.token_ids) - 1 for c in pending}
        revived_rows = sum(n for seq_id, n in old_rows.items() if seq_id in revived)
        per_row = seconds / (FORWARD_FIXED_ROWS + num_rows) if num_rows else 0.0
        self.sunk_draft_seconds = per_row * (sum(old_rows.values()) - revived_rows)
        self.catch_up_seconds = per_row * revived_rows
        self.catch_up_rows = revived_rows

    def _resume(self, r: DraftRequest) -> None:
        """A silent sequence asked (again) restarts on its newest HEAD_WINDOW entries; a
        dormant one wakes, its window starting at the step the target runs next."""
        state = self._state(r.seq_id)
        if state.dormant:
            state.dormant = False
            state.base = len(r.token_ids) - 1  # the positions the target's KV holds
        elif self._is_silent(state) and len(state.tokens) > HEAD_WINDOW:
            self._restart_window(r.seq_id, state)
        state.asked_len = len(r.token_ids)

    def _can_draft(self, r: DraftRequest) -> bool:
        """The newest committed entry must be the one before the sequence's last token, and the
        head's context and cache must hold the draft."""
        state = self._state(r.seq_id)
        committed = len(r.token_ids) - 1  # x_N (the last token) is not in the target's KV yet
        need = state.cached_len + r.params.n_max  # head slots
        return (r.params.n_max > 0 and state.last is not None
                and state.base + state.cached_len == committed
                and need < self.max_positions and self.cache.can_grow(r.seq_id, need))

    def _forward(self, chunks: list[SeqChunk], hidden: torch.Tensor, with_logits: bool = True):
        """One batched head forward over `chunks` (entries at their positions, fed `hidden`
        [T, hidden], or the captured features the native layer fuses: `_layer_hidden`); their
        K/V stay in the cache up to each chunk's end. Returns (logits [R, draft_vocab], h_out
        [R, hidden], greedy picks [(col, prob)] * R or None) of the rows that asked for logits
        (only h_out without `with_logits`), or None when the head's cache is full."""
        try:
            batch = build_forward_batch(self.cache, chunks, self.cache.k[0].device)
        except CacheFullError:
            return None
        self.num_draft_forwards += 1
        h_out, logits, picks = self._run_layer(batch, hidden,
                                               batch.logits_indices if with_logits else None)
        for chunk in chunks:
            self.cache.set_length(chunk.seq_id, chunk.start_pos + len(chunk.token_ids))
        rows = h_out.index_select(0, batch.logits_indices)
        if not with_logits:
            return rows
        if logits is None:
            return self._draft_logits(rows), rows, None
        return logits, rows, picks

    def _run_layer(self, batch: ForwardBatch, hidden: torch.Tensor,
                   logits_rows: torch.Tensor | None = None):
        """The head's decoder layers over the ragged batch, each one's K/V written to its
        layer of the paged cache: (h_out [T, hidden], the draft logits of rows `logits_rows`
        when the packed layer computes them in the same call, else None; and then, greedy,
        their picks [(col, prob)], else None). The packed layer looks the tokens up itself when
        it has the target's token table, and picks in the same call (`row_argmax`'s answer).
        A head of more layers runs its first on the packed layer and the others after it
        (`_further_layers`); its logits are then the caller's (`_draft_logits`)."""
        head, layer = self.head, self.packed_layer
        if layer is not None:
            inputs = batch.token_ids if layer.embed_table is not None \
                else head.embed(batch.token_ids)  # [T] ids or [T, hidden]
            if self.num_layers > 1:
                h_out = layer(inputs, hidden, batch, self.cache.k[0], self.cache.v[0])[0]
                return self._further_layers(batch, h_out), None, None
            pick = logits_rows is not None and self.config.temperature == 0.0
            h_out, logits, cols, probs = layer(inputs, hidden, batch, self.cache.k[0],
                                               self.cache.v[0], logits_rows, pick)
            if logits_rows is None:
                return h_out, None, None
            return h_out, logits, list(zip(cols.tolist(), probs.tolist())) if pick else None
        embeds = head.embed(batch.token_ids)  # [T, hidden]
        return run_layers(head, embeds, hidden.to(embeds.dtype),
                          lambda i, q, k, v: self._paged_attention(i, batch, q, k, v)), None, None

    def _further_layers(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """Layers 1.. of a deeper head over the batch, fed layer 0's output `hidden` [T, d]
        (natively where `further_stack` runs, else op by op)."""
        if self.further_stack is not None:
            return self.packed_layer.further_layers(hidden, self.further_stack, batch,
                                                    self.cache.k[1:], self.cache.v[1:])
        for i in range(1, self.num_layers):
            q, k, v, residual = self.head.project_qkv_at(i, None, hidden)
            hidden = self.head.finish_at(i, self._paged_attention(i, batch, q, k, v), residual)
        return hidden

    def _paged_attention(self, layer: int, batch: ForwardBatch, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [T, H, hd], k / v [T, KV, hd] not rotated -> [T, H * hd]; K/V written to `layer`
        head = self.head
        q = head.apply_rope(q, batch.positions)
        k = head.apply_rope(k, batch.positions)
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        write_kv(k_cache, v_cache, batch.slot_mapping, k, v)
        attn = paged_attention(q.contiguous().float(), k_cache, v_cache, batch.block_tables,
                               batch.token_seq, batch.positions_i32(),
                               head.config.head_dim ** -0.5)  # [T, H, hd]
        return attn.reshape(attn.shape[0], -1)

    def _draft_logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """h_out [R, hidden] -> draft logits [R, draft_vocab], on the packed layer's kernels
        when it runs (as its own call computes them)."""
        if self.packed_layer is not None:
            return self.packed_layer.logits(h_out)
        return self.head.draft_logits(h_out)

    def _extend(self, chunks, out, by_id, grown):
        """Pick each sequence's next draft token from its newest entry's logits; the sequences
        still drafting get a draft entry (that token, fed the entry's hidden) after it."""
        logits, h_rows, greedy = out
        next_chunks, next_inputs = [], []
        draws = [(by_id[c.seq_id].draws, len(grown[c.seq_id].ids)) for c in chunks]
        for row, (chunk, (tok, prob, q)) in enumerate(zip(chunks,
                                                          self._pick(logits, draws, greedy))):
            r, grow = by_id[chunk.seq_id], grown[chunk.seq_id]
            if not grow.offer(tok, prob, q, r.params, self.continuation):
                continue
            pos = chunk.start_pos + 1  # the draft entry: (this hidden, this token)
            if len(grow.ids) < r.params.n_max and tok not in self.eos_token_ids \
                    and pos + 1 < self.max_positions and self.cache.can_grow(chunk.seq_id, pos + 1) \
                    and self.continuation.worth(grow.need(r.params), r.params.further_cost):
                next_chunks.append(SeqChunk(chunk.seq_id, pos, [tok], 1))
                next_inputs.append(h_rows[row:row + 1])
        return next_chunks, next_inputs

    def _pick(self, logits: torch.Tensor, draws: list[tuple[TargetDraws | None, int]],
              greedy: list[tuple[int, float]] | None = None
              ) -> list[tuple[int, float, torch.Tensor | None]]:
        """logits [R, draft_vocab] -> per row (target token id, its draft probability, q over
        the target's vocabulary [vocab] when sampling). A row whose target samples (`draws`:
        how, and the draft position) draws with the target's filters and uniform there
        (`coupled.py`). Greedy: every row's argmax and its softmax probability in one native
        pass (per row, with a host read per scalar, ~70 us of a ~1.6 ms drafting round at c=1;
        as four PyTorch ops, ~45 us for one row); `greedy`: those picks (column, probability)
        when the head's native layer made them in its call."""
        if self._couples and any(d is not None for d, _ in draws):
            picks = self._pick(logits, [(None, 0)] * len(draws), greedy) \
                if any(d is None for d, _ in draws) else [None] * len(draws)
            for row, (d, position) in enumerate(draws):
                if d is not None:
                    col, prob = coupled_pick(logits[row], d, position)
                    picks[row] = (self._draft_id_list[col], prob, None)
            return picks
        if self.config.temperature == 0.0:
            if greedy is None:
                cols, probs = row_argmax(logits.float().contiguous(), with_prob=True)  # [R], [R]
                greedy = zip(cols.tolist(), probs.tolist())
            return [(self._draft_id_list[col], prob, None) for col, prob in greedy]
        picks = []
        for row in logits:
            probs = torch.softmax(row.float() / self.config.temperature, dim=-1)
            col = int(torch.multinomial(probs, 1, generator=self._generator))
            q = probs.new_zeros(self.vocab_size).index_copy_(0, self.draft_ids, probs)
            picks.append((int(self.draft_ids[col]), float(probs[col]), q))
        return picks


class TargetEmbedding:
    """The target's (packed) token embedding with the `.embed(ids)` the head calls, and its
    packed table (`table`, None when the target keeps none) for the head's native layer."""

    __slots__ = ("embed", "table")

    def __init__(self, target: TargetView):
        self.embed = target.embed
        self.table = target.embed_table
