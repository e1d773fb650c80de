"""Causal attention of a ragged batch of query tokens over a paged KV cache."""
from __future__ import annotations

import torch

from speculant.kernels.kv_layout import (cache_block_size, cache_heads, gather_k, gather_v,
                                         is_tile_layout, native_block_size)
from speculant.kernels.native import native_available, tile_kv_cache

FALLBACK_TOKEN_CHUNK = 64  # query tokens gathered at once by the fallback (bounds its memory)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D] float32
    k_cache: torch.Tensor,  # [num_blocks, Hkv, D, block_size] float32 or float16 (kv_layout.py)
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32 or float16
    block_tables: torch.Tensor,  # [S, max_blocks] int32, row s = cache blocks of sequence s
    token_seq: torch.Tensor,  # [T] int32, row of block_tables for each query token
    token_pos: torch.Tensor,  # [T] int32, position of each query token in its sequence
    scale: float,
    *,
    native: bool | None = None,
    prompt_lens: torch.Tensor | None = None,  # [S] int32 prompt length of each sequence
) -> torch.Tensor:
    """softmax(scale * q k^T) v per query token and head; returns [T, Hq, D] float32.

    Token t attends to positions 0..token_pos[t] (inclusive) of its sequence; position p lives at
    row p % block_size of cache block block_tables[token_seq[t], p // block_size] (K blocks
    transposed, kernels/kv_layout.py). The caller has
    already written the batch's own K/V into the cache. Query head h reads KV head
    h // (Hq // Hkv) (grouped-query attention).

    Runs natively (csrc/attention.cpp) when the tensors are on the CPU, head_dim and block_size
    are multiples of 8, block_size divides 256 and `native_available()` (the index tensors must then be int32, as documented above); each
    (token, head) output then depends only on its own query and its sequence's cache, bit for
    bit, whatever else is in the batch or however many threads run it. `native=False` forces the
    PyTorch fallback, which runs on any device and is exact to fp32 rounding but, as its
    reductions are torch's, not guaranteed bit-identical across batch compositions.

    `prompt_lens` marks prompt positions (a token at a position below its sequence's entry):
    natively, with an fp16 cache on an AMX-BF16 CPU (`native.prompt_attention()`), their scores
    run on bf16 tiles with split operands: within fp32 rounding of the fp32 path, not bit-identical
    to it, still batch-invariant. Generated positions, and the fallback, ignore it.
    """
    op = None if native is False else _native_op(q, v_cache)
    if op is None and native:
        raise RuntimeError("native paged_attention requested but unavailable for these inputs")
    if op is not None:
        return op(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale, prompt_lens)
    return _fallback(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale)


def _native_op(q: torch.Tensor, v_cache: torch.Tensor):
    if (q.is_cpu and v_cache.is_cpu and q.shape[-1] % 8 == 0
            and native_block_size(cache_block_size(v_cache)) and native_available()
            and (not is_tile_layout(v_cache.dtype) or tile_kv_cache())):
        return torch.ops.speculant.paged_attention.default
    return None


def _fallback(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale) -> torch.Tensor:
    num_tokens = q.shape[0]
    out = torch.empty_like(q)
    for t0 in range(0, num_tokens, FALLBACK_TOKEN_CHUNK):
        t1 = min(num_tokens, t0 + FALLBACK_TOKEN_CHUNK)
        out[t0:t1] = _attend_chunk(q[t0:t1], k_cache, v_cache, block_tables,
                                   token_seq[t0:t1].long(), token_pos[t0:t1].long(), scale)
    return out


def _attend_chunk(q, k_cache, v_cache, block_tables, seq, pos, scale) -> torch.Tensor:
    # q [T, Hq, D]; seq, pos [T] int64 -> [T, Hq, D]
    num_tokens, num_heads, head_dim = q.shape
    block_size, (num_kv_heads, _) = cache_block_size(v_cache), cache_heads(v_cache)
    group = num_heads // num_kv_heads
    length = int(pos.max()) + 1  # one host sync per chunk: the fallback is not the fast path
    p = torch.arange(length, device=q.device)  # [L]
    blocks = block_tables.long()[seq][:, p // block_size]  # [T, L]
    slots = blocks * block_size + p % block_size  # [T, L]
    k = gather_k(k_cache, slots, block_size).to(q.dtype)  # [T, L, Hkv, D]
    v = gather_v(v_cache, slots).to(q.dtype)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)  # [T, Hkv, group, D]
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, k) * scale  # [T, Hkv, group, L]
    future = p[None, :] > pos[:, None]  # [T, L]
    scores = scores.masked_fill(future[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("tkgl,tlkd->tkgd", probs, v)  # [T, Hkv, group, D]
    return out.reshape(num_tokens, num_heads, head_dim)
