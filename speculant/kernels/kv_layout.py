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

A bfloat16 cache is kept in the AMX tiles' own layout instead, where a tile product reads its B
operand as rows of element pairs (2r, 2r + 1) of 16 columns: K blocks [num_kv_heads, head_dim / 2,
block_size, 2] (a 16-position tile of 32 features is 16 rows of the block's feature pairs) and V
blocks [num_kv_heads, block_size / 2, head_dim, 2] (a tile of 16 features is the block's position
pairs). Attention then loads its operands straight from the cache, every query position alike
(csrc/avx512/attention_tiles.cpp); the dtype alone tells the layouts apart.
"""
from __future__ import annotations

import torch

TILE_DTYPE = torch.bfloat16  # a cache of this dtype is in the tiles' layout
TILE_BLOCK = 32  # its block size: 16 position pairs, one value-sum tile product


def is_tile_layout(dtype: torch.dtype) -> bool:
    return dtype == TILE_DTYPE


def k_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype | None = None) -> tuple[int, ...]:
    if is_tile_layout(dtype):
        return (num_blocks, num_kv_heads, head_dim // 2, block_size, 2)
    return (num_blocks, num_kv_heads, head_dim, block_size)


def v_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype | None = None) -> tuple[int, ...]:
    if is_tile_layout(dtype):
        return (num_blocks, num_kv_heads, block_size // 2, head_dim, 2)
    return (num_blocks, block_size, num_kv_heads, head_dim)


def check_tile_shape(block_size: int, head_dim: int) -> None:
    """A cache in the tiles' layout needs whole 32-position value-sum products in a block (16
    position pairs), blocks that tile attention's 256-position partitions, and 32-feature query
    slices."""
    if block_size % TILE_BLOCK or 256 % block_size:
        raise ValueError(f"a bfloat16 KV cache needs block_size a multiple of {TILE_BLOCK} "
                         f"dividing 256, got {block_size}")
    if head_dim % 32 or head_dim > 128:
        raise ValueError(f"a bfloat16 KV cache needs head_dim a multiple of 32 up to 128, "
                         f"got {head_dim}")


def cache_block_size(v_cache: torch.Tensor) -> int:
    return v_cache.shape[2] * 2 if is_tile_layout(v_cache.dtype) else v_cache.shape[1]


def cache_heads(v_cache: torch.Tensor) -> tuple[int, int]:
    """(num_kv_heads, head_dim) of a cache."""
    if is_tile_layout(v_cache.dtype):
        return v_cache.shape[1], v_cache.shape[3]
    return v_cache.shape[2], v_cache.shape[3]


def native_block_size(block_size: int) -> bool:
    """Whether the native attention takes this block size: its 8-position score vectors must not
    cross a block, and blocks must tile its 256-position softmax partitions."""
    return block_size % 8 == 0 and 256 % block_size == 0


def write_kv(k_cache: torch.Tensor,  # [num_blocks, Hkv, D, block_size] (or the tiles' layout)
             v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
             slots: torch.Tensor,  # [T] int, cache slot of each token
             k: torch.Tensor,  # [T, Hkv, D]
             v: torch.Tensor) -> None:  # [T, Hkv, D]
    """Stores each token's K and V at its slot (rounded to the cache's dtype: fp16 and bf16 to
    nearest)."""
    slots = slots.long()
    block_size = cache_block_size(v_cache)
    block, row = slots // block_size, slots % block_size
    if is_tile_layout(k_cache.dtype):
        num_kv_heads, head_dim = cache_heads(v_cache)
        k_pairs = k.to(k_cache.dtype).reshape(-1, num_kv_heads, head_dim // 2, 2)
        k_cache[block, :, :, row, :] = k_pairs  # [T, Hkv, D / 2, 2]
        v_cache[block, :, row // 2, :, row % 2] = v.to(v_cache.dtype)  # [T, Hkv, D]
        return
    k_cache[block, :, :, row] = k.to(k_cache.dtype)
    v_cache.view(-1, v_cache.shape[2], v_cache.shape[3]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_k(k_cache: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """K rows of `slots` (any shape S) -> [*S, Hkv, D], in the cache's dtype."""
    slots = slots.long()
    if is_tile_layout(k_cache.dtype):
        pairs = k_cache[slots // block_size, :, :, slots % block_size, :]  # [*S, Hkv, D / 2, 2]
        return pairs.flatten(-2)
    return k_cache[slots // block_size, :, :, slots % block_size]


def gather_v(v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """V rows of `slots` (any shape S) -> [*S, Hkv, D], in the cache's dtype."""
    if is_tile_layout(v_cache.dtype):
        slots = slots.long()
        block_size = cache_block_size(v_cache)
        row = slots % block_size
        return v_cache[slots // block_size, :, row // 2, :, row % 2]
    return v_cache.reshape(-1, v_cache.shape[2], v_cache.shape[3])[slots.long()]
