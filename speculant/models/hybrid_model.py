"""What every hybrid family shares: a pre-norm residual stack of (token mixer, MLP) layers over
a paged KV cache (attention layers) and a state cache (recurrent layers).

`forward(batch, cache, states)` runs one ragged batch: prompt chunks and decode/verification rows
of many sequences at their own positions, as `llama.Model.forward` does, plus `states`: each
chunk's slot in the state cache and whether to keep its state after every row (`StepStates`,
returned in `HybridOutput.step_states` for a speculative round's per-step snapshots). A family
(`lfm2.py`, `qwen3_next.py`) only says how its weights become mixers and MLPs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.engine.forward_batch import ForwardBatch
from speculant.engine.kv_cache import KVCache
from speculant.engine.state_cache import (HybridCache, StateBatch, StateCache, StateLayout,
                                             StepStates)
from speculant.kernels import PackedLinear
from speculant.models.hybrid_config import HybridConfig
from speculant.models.hybrid_layers import ForwardRun, rms_norm, rope_tables


@dataclass(slots=True)
class HybridOutput:
    logits: torch.Tensor  # [R, vocab_size] fp32, rows = batch.logits_indices
    # layer -> [H, hidden] its output (pre-norm) at rows batch.hidden_rows (all T rows if None)
    hidden_states: dict[int, torch.Tensor]
    step_states: dict[int, StepStates]  # seq_id -> state after each row (keep_steps chunks only)
    argmax: torch.Tensor | None = None  # [R] each logits row's argmax (ForwardOutput.argmax)


@dataclass(slots=True)
class HybridLayer:
    mixer_norm: torch.Tensor  # [hidden]
    mixer: object  # Attention | ShortConv | GatedDeltaNet: mixer(x, run) -> [T, hidden]
    mlp_norm: torch.Tensor  # [hidden]
    mlp: object  # SwiGLU | SparseMoe: mlp(x) -> [T, hidden]


class HybridModel:
    def __init__(self, config: HybridConfig, weights: dict, layers: list[HybridLayer],
                 embed: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor,
                 device="cpu"):
        self.config = config
        self.weights = weights  # HF name -> fp32 tensor, as loaded
        self.device = torch.device(device)
        self.layers = layers
        # [vocab, hidden] as fp32 PackedLinears: exact embedding rows, and the LM head drafters
        # share through TargetView (one matrix when tied)
        self.embed = PackedLinear.from_float(embed, "F32").to(self.device)
        self.lm_head = (self.embed if lm_head is embed
                        else PackedLinear.from_float(lm_head, "F32").to(self.device))
        self.final_norm = final_norm  # [hidden]
        self.path = "torch"

    @property
    def nbytes(self) -> int:
        """Bytes of the weights as loaded (fp32)."""
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    # ---- caches ------------------------------------------------------------------------------

    def new_kv_cache(self, num_blocks: int, block_size: int = 16,
                     dtype: torch.dtype = torch.float32, num_state_slots: int = 16) -> HybridCache:
        """A paged KV cache with one layer per *attention* layer (recurrent layers keep none),
        carrying the state cache: a sequence's state slot comes and goes with its KV."""
        c = self.config
        return HybridCache(len(c.attention_layers), c.num_kv_heads, c.head_dim, num_blocks,
                           block_size, dtype, self.device, states=self.new_state_cache(num_state_slots))

    def state_layout(self) -> StateLayout:
        c = self.config
        conv = {i: (c.conv_channels(i), c.conv_kernel - 1) for i in c.state_layers}
        recurrent = {i: (c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
                     for i, kind in enumerate(c.layer_kinds) if kind == "deltanet"}
        return StateLayout(conv, recurrent)

    def new_state_cache(self, num_slots: int) -> StateCache:
        return StateCache(self.state_layout(), num_slots, torch.float32, self.device, grow=True)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] int64 -> [T, hidden] float32."""
        return self.embed.embed(token_ids)

    # ---- forward -----------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, states: StateBatch) -> HybridOutput:
        """`states`: from `cache.states.batch(seq ids of the chunks, keep_steps)`."""
        c = self.config
        if len(states.slots) != len(batch.cu_num_tokens) - 1:
            raise ValueError(f"state batch has {len(states.slots)} chunks, the forward batch "
                             f"{len(batch.cu_num_tokens) - 1}")
        cos, sin = rope_tables(batch.positions, c.rotary_dim, c.rope_theta)
        run = ForwardRun(batch, cache, states, cos, sin, batch.positions_i32(), {})
        h = self.embed_tokens(batch.token_ids)  # [T, hidden], the residual stream
        wanted = set(batch.hidden_layers)
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = h + layer.mixer(rms_norm(h, layer.mixer_norm, c.rms_norm_eps), run)
            h = h + layer.mlp(rms_norm(h, layer.mlp_norm, c.rms_norm_eps))
            if i in wanted:
                hidden[i] = h if batch.hidden_rows is None else h.index_select(0, batch.hidden_rows)
        x = rms_norm(h.index_select(0, batch.logits_indices), self.final_norm, c.rms_norm_eps)
        if batch.greedy_picks:
            logits, argmax = self.lm_head.with_argmax(x)
            return HybridOutput(logits, hidden, run.steps, argmax)
        return HybridOutput(self.lm_head(x), hidden, run.steps)

