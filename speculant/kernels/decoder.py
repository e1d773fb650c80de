"""The whole decoder stack of a Llama-family model in one native call (csrc/decoder.cpp).

It chains the same native kernels as the model's op-by-op path (RMSNorm, QKV projection, RoPE
with the KV cache write, paged attention, output projection, residual add + norm, gate/up
projection, SiLU gate, down projection, residual add + next norm), so it returns bit-identical
results; what it saves is ~270 Python-to-C++ operator calls per forward (~1 ms of a ~8 ms decode
step). Native only: callers keep the op-by-op path as the reference and the fallback.
"""
from __future__ import annotations

import weakref

import torch

from speculant.kernels.packed_linear import QTYPES, PackedLinear

LINEARS = ("qkv", "attn_output", "gate_up", "down")  # per layer, in decoder_stack's order


class RegisteredStack:
    """A model's layer weights registered with the native decoder_stack, which then names them
    by id: passing ~500 tensors from Python at every step would cost ~100 us. The registry holds
    references to the tensors until the object is garbage-collected."""

    __slots__ = ("id", "__weakref__")

    def __init__(self, layers):
        """`layers`: per-layer weights with the attributes of model.LayerWeights."""
        weights: list[torch.Tensor | None] = []  # 17 per layer, csrc/decoder.cpp's Slot order
        qtypes: list[int] = []  # 4 per layer (LINEARS), each an index into QTYPES
        for layer in layers:
            def packed(m: PackedLinear) -> list:
                qtypes.append(QTYPES.index(m.qtype))
                return [m.data, m.scales, m.mins]

            weights += [layer.attn_norm, *packed(layer.qkv), layer.qkv_bias, layer.q_norm,
                        layer.k_norm, *packed(layer.attn_output), layer.ffn_norm,
                        *packed(layer.gate_up), *packed(layer.down)]
        out_features = [getattr(layers[0], m).out_features for m in LINEARS]
        self.id = torch.ops.speculant.decoder_stack_register.default(weights, qtypes,
                                                                    out_features)
        weakref.finalize(self, torch.ops.speculant.decoder_stack_release.default, self.id)


def decoder_stack(
    h: torch.Tensor,  # [T, hidden] float32 embeddings; becomes the last layer's output
    stack: RegisteredStack,
    k_caches: list[torch.Tensor],  # per layer [num_blocks, num_kv_heads, head_dim, block_size]
    v_caches: list[torch.Tensor],
    cos: torch.Tensor,  # [max_positions, head_dim]
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T] int64
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    token_seq: torch.Tensor,  # [T] int32
    token_pos: torch.Tensor,  # [T] int32 (positions, as paged_attention takes them)
    final_norm: torch.Tensor,  # [hidden]
    hidden_layers: list[int],  # layers whose output is returned, ascending
    num_heads: int,
    eps: float,
    scale: float,
    hidden_rows: torch.Tensor | None = None,  # [H] int64 rows of h to return; None = all
    prompt_lens: torch.Tensor | None = None,  # [S] int32 prompt lengths (paged_attention's)
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Runs every layer; returns final_norm(h) [T, hidden] and, for each of hidden_layers, a
    copy of h after that layer: [T, hidden], or [H, hidden] its rows `hidden_rows`."""
    return torch.ops.speculant.decoder_stack.default(
        h, stack.id, k_caches, v_caches, cos, sin, positions, slot_mapping, block_tables,
        token_seq, token_pos, final_norm, hidden_layers, num_heads, eps, scale, hidden_rows,
        prompt_lens)
