"""EAGLE-3's decoder layer at inference, on the target's fused native kernels.

`Eagle3Head.project_qkv` / `finish` are the reference maths (training, tests, other devices):
about 25 PyTorch operators per forward. Drafting runs the layer for one or a few rows per
sequence, where each operator's Python and dispatch cost, not arithmetic, sets the time. This
runs the same layer as the target's layers run (`models/llama.py`): fused QKV and gate/up
projections packed like the head's other matrices, RoPE with the KV write, paged attention, the
residual add fused with the next norm, and then the final norm and the LM head over the rows
that draft, all in one native call (csrc/head_layer.cpp; chained from Python, its ~13 kernel
calls cost ~0.2 ms of dispatch per forward, as much as the kernels at one row). The weights are
the head's packed ones (`pack_linears`), so the projections are bit-identical to the reference
path's; norms and adds round like the target's kernels do (outputs and K/V within 1e-4 of the
reference, tested).

A head of more layers runs its further layers, plain Llama decoder layers, on the target's own
native decoder stack (`further_layer_stack`): run op by op they took a c=1 mt_bench run's draft
share from 19% to 27% (AMD EPYC Zen 4, the shipped head deepened with a pass-through layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculant.engine.forward_batch import ForwardBatch
from speculant.kernels import PackedLinear, rms_norm
from speculant.kernels.decoder import RegisteredStack, decoder_stack
from speculant.kernels.packed_linear import QTYPES
from speculant.models.llama import LayerWeights


@dataclass(slots=True)
class PackedEagle3Layer:
    input_norm: torch.Tensor  # [d] fp32, on the token embedding
    hidden_norm: torch.Tensor  # [d] fp32, on the fused feature or the previous output
    qkv: PackedLinear  # [2d] -> [(H + 2 KV) * hd]
    o_proj: PackedLinear  # [H * hd] -> [d]
    post_norm: torch.Tensor  # [d] fp32
    gate_up: PackedLinear  # [d] -> [2 I]
    down: PackedLinear  # [I] -> [d]
    final_norm: torch.Tensor  # [d] fp32, before the LM head
    lm_head: PackedLinear  # [d] -> [draft_vocab]
    rope_cos: torch.Tensor  # [max_positions, hd]
    rope_sin: torch.Tensor
    num_heads: int
    eps: float
    scale: float
    # the target's packed token table [vocab, d] (None: the caller passes embeddings)
    embed_table: PackedLinear | None = None
    fc: PackedLinear | None = None  # [n_feat * d] -> [d] (None: the caller passes fused hidden)
    # the native call's weight list (csrc/head_layer.cpp's Slot order), qtype codes and widths,
    # derived from the fields above
    weights: list = field(init=False)
    qtypes: list = field(init=False)
    out_features: list = field(init=False)

    def __post_init__(self) -> None:
        linears = (self.qkv, self.o_proj, self.gate_up, self.down, self.lm_head,
                   self.embed_table, self.fc)

        def packed(m: PackedLinear | None) -> list:
            return [None] * 3 if m is None else [m.data, m.scales, m.mins]

        self.weights = [self.input_norm, self.hidden_norm, *packed(self.qkv),
                        *packed(self.o_proj), self.post_norm, *packed(self.gate_up),
                        *packed(self.down), self.final_norm, *packed(self.lm_head),
                        *packed(self.embed_table), *packed(self.fc)]
        self.qtypes = [-1 if m is None else QTYPES.index(m.qtype) for m in linears]
        self.out_features = [0 if m is None else m.out_features for m in linears]

    @classmethod
    def of(cls, head) -> PackedEagle3Layer | None:
        """The layer of an `Eagle3Head` whose linears are packed (`pack_linears`); None when
        they are not (float32 weights keep the reference path)."""
        m, c = head.midlayer, head.config
        a, mlp = m.self_attn, m.mlp
        mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj,
                head.lm_head)
        if not all(hasattr(x, "packed") for x in mods):
            return None

        def vec(norm) -> torch.Tensor:
            return norm.weight.detach().float().contiguous()

        table = None if head.embed_tokens is not None else \
            getattr(head._target_embed, "table", None)
        return cls(input_norm=vec(m.input_layernorm), hidden_norm=vec(m.hidden_norm),
                   qkv=PackedLinear.concat([a.q_proj.packed, a.k_proj.packed, a.v_proj.packed]),
                   o_proj=a.o_proj.packed, post_norm=vec(m.post_attention_layernorm),
                   gate_up=PackedLinear.concat([mlp.gate_proj.packed, mlp.up_proj.packed]),
                   down=mlp.down_proj.packed, final_norm=vec(head.norm),
                   lm_head=head.lm_head.packed, rope_cos=head.rope_cos, rope_sin=head.rope_sin,
                   num_heads=c.num_heads, eps=c.rms_norm_eps, scale=c.head_dim ** -0.5,
                   embed_table=table if isinstance(table, PackedLinear) and
                   table.qtype in QTYPES else None,
                   fc=getattr(head.fc, "packed", None))

    def __call__(self, inputs: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                 k_cache: torch.Tensor, v_cache: torch.Tensor,
                 logits_rows: torch.Tensor | None = None, pick: bool = False):
        # inputs: token ids [T] int64 (needs embed_table) or their embeddings [T, d]; hidden
        # [T, d] fused feature or previous output, or the captured features [T, n_feat * d]
        # (needs fc); k_cache [num_blocks, KV, hd, block_size] / v_cache [num_blocks,
        # block_size, KV, hd] (kernels/kv_layout.py), written at batch.slot_mapping;
        # logits_rows [R] int64
        """-> (h_out [T, d], the layer's output before the head's final norm; logits
        [R, draft_vocab] of its rows `logits_rows`, [0, draft_vocab] without them; with `pick`
        each logits row's argmax column [R] int64 and its softmax probability [R], as
        `row_argmax(logits, with_prob=True)` gives them, else empty tensors)."""
        return torch.ops.speculant.eagle3_layer.default(
            inputs, hidden, self.weights, self.qtypes, self.out_features, self.rope_cos,
            self.rope_sin, batch.positions, k_cache, v_cache, batch.slot_mapping,
            batch.block_tables, batch.token_seq, batch.positions_i32(), logits_rows,
            self.num_heads, self.eps, self.scale, pick)

    def further_layers(self, hidden: torch.Tensor, stack, batch: ForwardBatch,
                       k_caches: list, v_caches: list) -> torch.Tensor:
        # hidden [T, d] the first layer's output (updated in place); k_caches / v_caches: the
        # further layers' caches, in order
        """-> the last further layer's output [T, d] (before the final norm): `stack`
        (`further_layer_stack`) on the target's native decoder stack, K/V written at
        batch.slot_mapping."""
        h = hidden.contiguous()
        decoder_stack(h, stack, k_caches, v_caches, self.rope_cos, self.rope_sin,
                      batch.positions, batch.slot_mapping, batch.block_tables, batch.token_seq,
                      batch.positions_i32(), self.final_norm, [], self.num_heads, self.eps,
                      self.scale)
        return h

    def logits(self, h_out: torch.Tensor) -> torch.Tensor:
        """h_out [R, d] -> [R, draft_vocab]: the final norm and the LM head, as the layer's call
        computes them for its `logits_rows`."""
        return self.lm_head(rms_norm(h_out.float().contiguous(), self.final_norm, self.eps))


def further_layer_stack(head) -> RegisteredStack | None:
    """A deeper head's layers 1.. (plain Llama decoder layers) registered with the target's
    native decoder stack, when their linears are packed; None for a one-layer head or float32
    weights (the reference path runs them then)."""
    extra = [head.layers[str(i)] for i in range(1, head.num_layers)]
    mods = [x for m in extra for x in (m.self_attn.q_proj, m.self_attn.k_proj,
                                       m.self_attn.v_proj, m.self_attn.o_proj,
                                       m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj)]
    if not extra or not all(hasattr(x, "packed") for x in mods):
        return None

    def vec(norm) -> torch.Tensor:
        return norm.weight.detach().float().contiguous()

    return RegisteredStack([LayerWeights(
        attn_norm=vec(m.input_layernorm),
        qkv=PackedLinear.concat([m.self_attn.q_proj.packed, m.self_attn.k_proj.packed,
                                 m.self_attn.v_proj.packed]),
        qkv_bias=None, q_norm=None, k_norm=None, attn_output=m.self_attn.o_proj.packed,
        ffn_norm=vec(m.post_attention_layernorm),
        gate_up=PackedLinear.concat([m.mlp.gate_proj.packed, m.mlp.up_proj.packed]),
        down=m.mlp.down_proj.packed) for m in extra])
