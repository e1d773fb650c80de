"""Rotary position embedding (NeoX / HF half-split convention), fused with the KV cache write."""
from __future__ import annotations

import torch

from speculant.kernels.kv_layout import cache_heads, write_kv
from speculant.kernels.rowwise import rms_norm_reference, use_native


def rope_cos_sin(head_dim: int, theta: float, max_positions: int, device="cpu"):
    """NeoX-style rotary tables (as HF computes them, in fp32): two [max_positions, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                                .float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, head_dim]; cos, sin [T, 1, head_dim]: HF's x * cos + rotate_half(x) * sin
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim] float32, q | k | v
    bias: torch.Tensor | None,  # [(num_heads + 2 * num_kv_heads) * head_dim] (Qwen2)
    q_norm: torch.Tensor | None,  # [head_dim] per-head RMSNorm weight of q (Qwen3)
    k_norm: torch.Tensor | None,  # [head_dim] likewise for k
    eps: float,
    cos: torch.Tensor,  # [max_positions, head_dim] from rope_cos_sin
    sin: torch.Tensor,  # [max_positions, head_dim]
    positions: torch.Tensor,  # [T] int64 (or int32), each token's position in its sequence
    k_cache: torch.Tensor,  # [num_blocks, num_kv_heads, head_dim, block_size] fp32/fp16, written
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] fp32/fp16, written
    slot_mapping: torch.Tensor,  # [T] int64 (or int32), flat cache slot of each token
    num_heads: int,
    *,
    native: bool | None = None,
) -> torch.Tensor:
    """Everything between the fused QKV projection and attention, in one pass per token: add the
    bias, RMS-normalize q and k per head, rotate them, write k and v into the cache at their
    slots; returns the rotated q [T, num_heads, head_dim].

    The native path (csrc/rope.cpp) follows the reference's order of operations and rounding, so
    both agree bit for bit without q/k norms and to ~1e-7 with them; each token's result depends
    only on that token.
    """
    if use_native(native, qkv, k_cache):
        return torch.ops.speculant.rope_write_kv.default(
            qkv, bias, q_norm, k_norm, eps, cos, sin, positions, k_cache, v_cache, slot_mapping,
            num_heads)
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = cache_heads(v_cache)
    if bias is not None:
        qkv = qkv + bias
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_reference(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm_reference(k, k_norm, eps)
    c = cos[positions].unsqueeze(1)  # [T, 1, head_dim]
    s = sin[positions].unsqueeze(1)
    # an fp16 cache stores k and v rounded to nearest (ties to even), as the native path does
    write_kv(k_cache, v_cache, slot_mapping, apply_rope(k, c, s),
             v.reshape(num_tokens, num_kv_heads, head_dim))
    return apply_rope(q, c, s).contiguous()
