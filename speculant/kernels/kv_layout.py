"""Where a token's K and V live inside a paged cache block.

A cache slot s is row `s % block_size` of block `s // block_size`.

V blocks are [block_size, num_kv_heads, head_dim]: one row per position holding every KV head,
which is how the value sums read them (each position's row, weighted by its probability).

K blocks are transposed, [num_kv_heads, head_dim, block_size]: for each KV head and feature, the
block's positions side by side. A vector of scores over 8 or 16 consecutive positions is then one
FMA chain over the features (q[d] broadcast, times feature d of those positions), with no
horizontal sums, and the same per-lane arithmetic on 8-lane (AVX2) and 16-lane (AVX-512) vectors.
Row-major K needed a hadd tree per 8 scores and, for fp16 caches, a conversion of every chunk:
measured on a Xeon (AMX, 1 thread), scores of 24 queries over 1,536 positions ran at ~57
GMAC/s in this layout, against ~33 for the row-major loop (attention with 8 rows at context
1500: 44% of its time in scores before).
"""
from __future__ import annotations

import torch


def k_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, int, int, int]:
    return (num_blocks, num_kv_heads, head_dim, block_size)


def v_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, int, int, int]:
    return (num_blocks, block_size, num_kv_heads, head_dim)


def cache_block_size(v_cache: torch.Tensor) -> int:
    return v_cache.shape[1]


def native_block_size(block_size: int) -> bool:
    """Whether the native attention takes this block size: its 8-position score vectors must not
    cross a block, and blocks must tile its 256-position softmax partitions."""
    return block_size % 8 == 0 and 256 % block_size == 0


def write_kv(k_cache: torch.Tensor,  # [num_blocks, Hkv, D, block_size]
             v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
             slots: torch.Tensor,  # [T] int, cache slot of each token
             k: torch.Tensor,  # [T, Hkv, D]
             v: torch.Tensor) -> None:  # [T, Hkv, D]
    """Stores each token's K and V at its slot (rounded to the cache's dtype: fp16 to nearest)."""
    slots = slots.long()
    block_size = cache_block_size(v_cache)
    k_cache[slots // block_size, :, :, slots % block_size] = k.to(k_cache.dtype)
    v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_k(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """K rows of `slots` (any shape S) -> [*S, Hkv, D], in the cache's dtype."""
    slots = slots.long()
    return k_cache[slots // block_size, :, :, slots % block_size]


def gather_v(v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """V rows of `slots` (any shape S) -> [*S, Hkv, D], in the cache's dtype."""
    return v_cache.reshape(-1, v_cache.shape[2], v_cache.shape[3])[slots.long()]
