"""One ragged batch for one model forward: tokens of many sequences, each at its own positions."""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from speculant.engine.kv_cache import KVCache


@dataclass(slots=True)
class SeqChunk:
    """A run of consecutive tokens of one sequence, starting at KV position `start_pos`."""

    seq_id: int
    start_pos: int
    token_ids: list[int]
    num_logits: int = 1  # logits wanted for the last `num_logits` tokens of the chunk (0 = none)
    # hidden states wanted (when the batch captures layers) for the last `num_feature_rows`
    # tokens of the chunk; None = all of them
    num_feature_rows: int | None = None
    # positions below this are the sequence's prompt (attention may run them on tiles: see
    # kernels/attention.py); 0 for decode and verification chunks, which hold none
    num_prompt_tokens: int = 0


@dataclass(slots=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, flat KV slot each token's K/V is written to
    block_tables: torch.Tensor  # [S, max_blocks] int32, row s = blocks of chunk s's sequence
    token_seq: torch.Tensor  # [T] int32, row of block_tables for each token
    logits_indices: torch.Tensor  # [R] int64, token rows whose logits are computed
    cu_num_tokens: list[int]  # [S + 1] prefix sums of chunk lengths
    cu_num_logits: list[int]  # [S + 1] prefix sums of logits rows per chunk
    hidden_layers: tuple[int, ...] = ()  # layers whose output hidden states are returned
    # [H] int64 token rows whose hidden states are returned, ascending; None = every row
    hidden_rows: torch.Tensor | None = None
    # [S + 1] prefix sums of returned hidden rows per chunk (== cu_num_tokens when all are)
    cu_num_hidden: list[int] | None = None
    # [S] int32 prompt length of each chunk's sequence, when a chunk holds prompt positions
    prompt_lens: torch.Tensor | None = None
    # [T] int32 `positions`, the attention kernels' index type (None: cast `positions`)
    token_pos: torch.Tensor | None = None
    # the model returns each logits row's argmax with the logits (`ForwardOutput.argmax`),
    # found as its LM head writes them: some row is picked greedily
    greedy_picks: bool = False

    def positions_i32(self) -> torch.Tensor:
        """`positions` as int32 [T] (built with the batch; a cast for one built by hand)."""
        return self.positions.to(torch.int32) if self.token_pos is None else self.token_pos

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def _host_tensor(typecode: str, values: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """values (non-empty) as a 1-D tensor of `dtype` (array typecode `typecode`: "q" int64, "i"
    int32) on `device`; on the CPU it keeps the array alive and shares its memory."""
    t = torch.frombuffer(array(typecode, values), dtype=dtype)
    return t if getattr(device, "type", device) == "cpu" else t.to(device)


def build_forward_batch(cache: KVCache, chunks: list[SeqChunk], device="cpu",
                        hidden_layers: tuple[int, ...] = ()) -> ForwardBatch:
    """Reserve KV room for every chunk and lay the batch out as flat tensors.

    Raises CacheFullError (nothing reserved for later chunks) if the cache cannot hold them.
    """
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_seq: list[int] = []
    logits_indices: list[int] = []
    hidden_rows: list[int] = []
    cu_tokens, cu_logits, cu_hidden = [0], [0], [0]
    tables: list[list[int]] = []
    prompt_lens = [chunk.num_prompt_tokens for chunk in chunks]
    for row, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError(f"sequence {chunk.seq_id}: empty chunk")
        cache.reserve(chunk.seq_id, chunk.start_pos + n)
        base = len(token_ids)
        token_ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_pos, chunk.start_pos + n))
        slots.extend(cache.slots(chunk.seq_id, chunk.start_pos, n))
        token_seq.extend([row] * n)
        logits_indices.extend(range(base + n - chunk.num_logits, base + n))
        cu_tokens.append(base + n)
        cu_logits.append(len(logits_indices))
        num_hidden = n if chunk.num_feature_rows is None else min(n, chunk.num_feature_rows)
        hidden_rows.extend(range(base + n - num_hidden, base + n))
        cu_hidden.append(len(hidden_rows))
        tables.append(cache.block_table(chunk.seq_id))
    max_blocks = max(len(t) for t in tables)
    num_tokens, num_seqs = len(token_ids), len(chunks)
    has_prompt = any(c.start_pos < c.num_prompt_tokens for c in chunks)
    want_rows = bool(hidden_layers) and len(hidden_rows) < num_tokens
    # Two host-to-tensor copies in all, one per dtype, each field a view of its run, and the
    # int32 positions made here rather than cast per forward: a one-row batch took 25.4 us
    # with six copies and the cast, 19.9 us now (Xeon with AMX), and a drafting round at c=1
    # builds three (the target's and two head forwards). Copied through an `array` buffer
    # (`_host_tensor`), not `torch.tensor(list)`: 0.8 against 2.6 us for a one-row batch's
    # five ints in a loop, and inside the engine's drafting the two calls had taken ~8% of
    # `eagle3`'s drafting round (py-spy, mt_bench at c=1).
    wide = token_ids + positions + slots + logits_indices + (hidden_rows if want_rows else [])
    narrow = token_seq + positions + (prompt_lens if has_prompt else [])
    for t in tables:
        narrow.extend(t)
        narrow.extend([0] * (max_blocks - len(t)))
    wide_t = _host_tensor("q", wide, torch.int64, device)
    narrow_t = _host_tensor("i", narrow, torch.int32, device)
    num_logits, num_rows = len(logits_indices), len(hidden_rows)
    w0, n0 = 3 * num_tokens, 2 * num_tokens + (num_seqs if has_prompt else 0)
    return ForwardBatch(
        token_ids=wide_t[:num_tokens],
        positions=wide_t[num_tokens:2 * num_tokens],
        slot_mapping=wide_t[2 * num_tokens:w0],
        block_tables=narrow_t[n0:].view(num_seqs, max_blocks),
        token_seq=narrow_t[:num_tokens],
        logits_indices=wide_t[w0:w0 + num_logits],
        cu_num_tokens=cu_tokens,
        cu_num_logits=cu_logits,
        hidden_layers=hidden_layers,
        # None when every row is wanted: the models then copy their layers' outputs whole
        hidden_rows=wide_t[w0 + num_logits:w0 + num_logits + num_rows] if want_rows else None,
        cu_num_hidden=cu_hidden,
        prompt_lens=narrow_t[2 * num_tokens:n0] if has_prompt else None,
        token_pos=narrow_t[num_tokens:2 * num_tokens],
    )
