"""EAGLE-3's decoder layer at inference, on the target's fused native kernels.

`Eagle3Head.project_qkv` / `finish` are the reference maths (training, tests, other devices):
about 25 PyTorch operators per forward. Drafting runs the layer for one or a few rows per
sequence, where each operator's Python and dispatch cost, not arithmetic, sets the time. This
runs the same layer as the target's layers run (`models/llama.py`): fused QKV and gate/up
projections packed as Q8_0, RoPE with the KV write, paged attention, the residual add fused with
the next norm: 11 kernel calls. The weights are the head's packed ones (`pack_linears`), so the
projections are bit-identical to the reference path's; norms and adds round like the target's
kernels do (outputs and K/V within 1e-4 of the reference, tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.engine.forward_batch import ForwardBatch
from speculant.kernels import (PackedLinear, add_rms_norm, paged_attention, rms_norm,
                               rope_write_kv, silu_mul)


@dataclass(slots=True)
class PackedEagle3Layer:
    input_norm: torch.Tensor  # [d] fp32, on the token embedding
    hidden_norm: torch.Tensor  # [d] fp32, on the fused feature or the previous output
    qkv: PackedLinear  # [2d] -> [(H + 2 KV) * hd]
    o_proj: PackedLinear  # [H * hd] -> [d]
    post_norm: torch.Tensor  # [d] fp32
    gate_up: PackedLinear  # [d] -> [2 I]
    down: PackedLinear  # [I] -> [d]
    rope_cos: torch.Tensor  # [max_positions, hd]
    rope_sin: torch.Tensor
    num_heads: int
    eps: float
    scale: float

    @classmethod
    def of(cls, head) -> PackedEagle3Layer | None:
        """The layer of an `Eagle3Head` whose linears are packed (`pack_linears`); None when
        they are not (float32 weights keep the reference path)."""
        m, c = head.midlayer, head.config
        a, mlp = m.self_attn, m.mlp
        mods = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if not all(hasattr(x, "packed") for x in mods):
            return None

        def vec(norm) -> torch.Tensor:
            return norm.weight.detach().float().contiguous()

        return cls(input_norm=vec(m.input_layernorm), hidden_norm=vec(m.hidden_norm),
                   qkv=PackedLinear.concat([a.q_proj.packed, a.k_proj.packed, a.v_proj.packed]),
                   o_proj=a.o_proj.packed, post_norm=vec(m.post_attention_layernorm),
                   gate_up=PackedLinear.concat([mlp.gate_proj.packed, mlp.up_proj.packed]),
                   down=mlp.down_proj.packed, rope_cos=head.rope_cos, rope_sin=head.rope_sin,
                   num_heads=c.num_heads, eps=c.rms_norm_eps, scale=c.head_dim ** -0.5)

    def __call__(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        # embeds [T, d] token embeddings; hidden [T, d] fused feature or previous output;
        # k_cache [num_blocks, KV, hd, block_size] / v_cache [num_blocks, block_size, KV, hd]
        # (kernels/kv_layout.py), written at batch.slot_mapping
        """-> h_out [T, d], the layer's output before the head's final norm."""
        eps, num_tokens = self.eps, embeds.shape[0]
        h = hidden.float().contiguous().clone()  # the residual carries the hidden
        x = torch.cat([rms_norm(embeds.float().contiguous(), self.input_norm, eps),
                       rms_norm(h, self.hidden_norm, eps)], dim=-1)  # [T, 2d]
        q = rope_write_kv(self.qkv(x), None, None, None, eps, self.rope_cos, self.rope_sin,
                          batch.positions, k_cache, v_cache, batch.slot_mapping,
                          self.num_heads)  # [T, H, hd]
        attn = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.token_seq,
                               batch.positions.to(torch.int32), self.scale)
        x = add_rms_norm(h, self.o_proj(attn.reshape(num_tokens, -1)), self.post_norm, eps)
        h.add_(self.down(silu_mul(self.gate_up(x))))
        return h
