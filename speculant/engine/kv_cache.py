"""Paged KV cache shared by many sequences, with O(1) rollback.

Memory layout, per layer: `v[layer]` is [num_blocks, block_size, num_kv_heads, head_dim], `k[layer]`
is [num_blocks, num_kv_heads, head_dim, block_size] (transposed blocks: kernels/kv_layout.py); a
bfloat16 cache is in the AMX tiles' layout (same module).
A sequence owns an ordered list of blocks (its block table); token at position p lives in block
`table[p // block_size]`, row `p % block_size`. Entries are written at absolute positions, so
rolling a sequence back to n tokens only lowers its length (and returns whole unused blocks to
the pool): rejected draft entries are simply beyond the length and get overwritten later.
"""
from __future__ import annotations

import torch

from speculant.kernels.huge_pages import empty_on_huge_pages
from speculant.kernels.kv_layout import check_tile_shape, is_tile_layout, k_cache_shape, v_cache_shape


# Element types a cache can hold, by the name the CLI and configs use. float16 halves the memory
# and the bytes attention reads per step; K and V are rounded to it when written. bfloat16 is
# kept in the AMX tiles' layout and attended on AMX-BF16 tiles or AVX512_BF16 dot products
# (kernels/kv_layout.py; CPUs with avx512_bf16).
KV_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}


class CacheFullError(RuntimeError):
    """Not enough free blocks; the caller should wait or refuse the request."""


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device="cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        if is_tile_layout(dtype):
            check_tile_shape(block_size, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        k_shape = k_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        v_shape = v_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, dtype)
        # Uninitialised on purpose: entries beyond a sequence's length are never read. On the
        # CPU on 2 MB pages: attention streams each sequence's cache every step.
        kv = empty_on_huge_pages([k_shape] * num_layers + [v_shape] * num_layers, dtype, device)
        if is_tile_layout(dtype):
            # the tiles multiply whole blocks: a numerator of exactly 0 meets the V entries past a
            # sequence's length, which must then be finite (0 x NaN is NaN): zeros until written
            for t in kv:
                t.zero_()
        self.k, self.v = kv[:num_layers], kv[num_layers:]
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}
        # Blocks every sequence holds beyond its tokens, for memory that is not K/V but is
        # budgeted like it (a hybrid model's recurrent state and its speculative checkpoints);
        # taken at `allocate`, returned at `free`, counted by `admission_blocks`.
        self.seq_overhead_blocks = 0
        self._overhead: dict[int, list[int]] = {}

    # ---- accounting --------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def admission_blocks(self, num_tokens: int) -> int:
        """Blocks a new sequence needs to hold `num_tokens`, its overhead included."""
        return self.blocks_needed(num_tokens) + self.seq_overhead_blocks

    @property
    def block_bytes(self) -> int:
        """Bytes of K and V one block holds, all layers."""
        return sum(t[0].nbytes for t in (*self.k, *self.v))

    def length(self, seq_id: int) -> int:
        return self._lengths[self._check(seq_id)]

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables[self._check(seq_id)]

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def can_grow(self, seq_id: int | None, new_length: int) -> bool:
        have = len(self._tables[seq_id]) if seq_id in self._tables else 0
        return self.blocks_needed(new_length) - have <= len(self._free_blocks)

    # ---- lifecycle ---------------------------------------------------------------------------

    def allocate(self, seq_id: int) -> None:
        if seq_id in self._tables:
            raise ValueError(f"KV cache: sequence {seq_id} is already allocated")
        if self.seq_overhead_blocks > len(self._free_blocks):
            raise CacheFullError(f"KV cache full: sequence {seq_id} needs {self.seq_overhead_blocks} "
                                 f"blocks for its state, {len(self._free_blocks)} free")
        self._overhead[seq_id] = [self._free_blocks.pop() for _ in range(self.seq_overhead_blocks)]
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0

    def reserve(self, seq_id: int, new_length: int) -> None:
        """Make room for positions [0, new_length) without changing the committed length."""
        table = self._tables[self._check(seq_id)]
        need = self.blocks_needed(new_length) - len(table)
        if need > len(self._free_blocks):
            raise CacheFullError(
                f"KV cache full: sequence {seq_id} needs {need} more blocks of {self.block_size} "
                f"tokens, {len(self._free_blocks)} free of {self.num_blocks}")
        for _ in range(need):
            table.append(self._free_blocks.pop())

    def set_length(self, seq_id: int, length: int) -> None:
        """Commit `length` tokens as valid (after a forward wrote them)."""
        table = self._tables[self._check(seq_id)]
        if not 0 <= length <= len(table) * self.block_size:
            raise ValueError(f"KV cache: length {length} outside the {len(table)} blocks "
                             f"reserved for sequence {seq_id}")
        self._lengths[seq_id] = length

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll back to the first `length` tokens: O(1) besides returning unused blocks."""
        self._check(seq_id)
        if not 0 <= length <= self._lengths[seq_id]:
            raise ValueError(f"KV cache: cannot truncate sequence {seq_id} of length "
                             f"{self._lengths[seq_id]} to {length}")
        self._lengths[seq_id] = length
        self._release_beyond(seq_id, self.blocks_needed(length))

    def trim_reservation(self, seq_id: int) -> None:
        """Return blocks reserved beyond the committed length."""
        self._release_beyond(seq_id, self.blocks_needed(self._lengths[self._check(seq_id)]))

    def free(self, seq_id: int) -> None:
        table = self._tables.pop(seq_id, None)
        self._lengths.pop(seq_id, None)
        if table:
            self._free_blocks.extend(reversed(table))
        self._free_blocks.extend(reversed(self._overhead.pop(seq_id, [])))

    # ---- addressing --------------------------------------------------------------------------

    def slots(self, seq_id: int, start: int, num_tokens: int) -> list[int]:
        """Flat slot index (block * block_size + row) of positions [start, start + num_tokens)."""
        table = self._tables[seq_id]
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + num_tokens)]

    def _release_beyond(self, seq_id: int, keep_blocks: int) -> None:
        table = self._tables[seq_id]
        while len(table) > keep_blocks:
            self._free_blocks.append(table.pop())

    def _check(self, seq_id: int) -> int:
        if seq_id not in self._tables:
            raise KeyError(f"KV cache: sequence {seq_id} is not allocated")
        return seq_id
