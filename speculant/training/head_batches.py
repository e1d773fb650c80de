"""Packed training rows over cached target features, for any drafter head.

A `Row` is several whole sequences (or tail windows of long ones) laid back to back, at most
`seq_len` tokens, with everything a head needs per token: the token ids, the target layers' hidden
states, positions within the sequence, which sequence each token belongs to, which tokens have a
feature (a sequence's last token never went through the target) and whose next token the target
generated. Heads shift these by however many tokens they predict ahead (EAGLE-3: t+1 with the
feature at t; a block drafter: t+1..t+k), with `shifted`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.training.head_data import FeatureShard


@dataclass(slots=True)
class Row:
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position within its sequence
    doc_ids: torch.Tensor  # [T] int64, which packed sequence
    has_feature: torch.Tensor  # [T] bool
    next_is_output: torch.Tensor  # [T] bool
    hidden: dict[int, torch.Tensor]  # layer -> [T, d] float16
    categories: list[str] | None = None  # per packed sequence (held-out rows)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    def features(self, layers) -> torch.Tensor:
        """[T, len(layers) * d] float32: the layers' hidden states concatenated in order."""
        return torch.cat([self.hidden[layer].float() for layer in layers], dim=-1)

    def shifted(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(index [T] of the token `offset` places later, clamped; valid [T] bool: that token
        exists in the same sequence)."""
        idx = torch.arange(self.num_tokens) + offset
        inside = idx < self.num_tokens
        idx = idx.clamp(max=self.num_tokens - 1)
        return idx, inside & (self.doc_ids[idx] == self.doc_ids)


def shard_windows(shards: list[FeatureShard], seq_len: int) -> list[tuple[int, int, int]]:
    """(shard index, start, end) flat ranges of at most seq_len tokens; a long sequence is cut
    from its end so the generated tokens keep the most context."""
    out = []
    for s, shard in enumerate(shards):
        bounds = shard.cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            while end - start > 1:
                out.append((s, max(start, end - seq_len), end))
                end -= seq_len
    return out


def pack_windows(windows: list[tuple[int, int, int]], seq_len: int) -> list[list[tuple[int, int, int]]]:
    """Windows packed in order into rows of at most seq_len tokens."""
    rows, row, used = [], [], 0
    for w in windows:
        n = w[2] - w[1]
        if used + n > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append(w)
        used += n
    return rows + ([row] if row else [])


def build_row(shards: list[FeatureShard], windows: list[tuple[int, int, int]],
              categories: list[str] | None = None) -> Row:
    """The Row of `windows` (each from shard_windows)."""
    parts = []
    for doc, (s, start, end) in enumerate(windows):
        shard = shards[s]
        seq = int(torch.searchsorted(shard.cu_seqlens, start, right=True)) - 1
        seq_start, seq_end = int(shard.cu_seqlens[seq]), int(shard.cu_seqlens[seq + 1])
        has_feature = torch.ones(end - start, dtype=torch.bool)
        if end == seq_end:
            has_feature[-1] = False
        parts.append((shard.token_ids[start:end].long(), torch.arange(start, end) - seq_start,
                      torch.full((end - start,), doc), has_feature,
                      shard.next_is_output[start:end],
                      {layer: h[start:end] for layer, h in shard.hidden.items()}))
    layers = parts[0][5].keys()
    return Row(*(torch.cat([p[i] for p in parts]) for i in range(5)),
               hidden={layer: torch.cat([p[5][layer] for p in parts]) for layer in layers},
               categories=categories)


def row_stream(shards: list[FeatureShard], seq_len: int, seed: int, skip: int = 0):
    """Rows forever, windows reshuffled each epoch; `skip` rows are drawn and dropped (resume)."""
    windows = shard_windows(shards, seq_len)
    gen = torch.Generator().manual_seed(seed)
    drawn = 0
    while True:
        order = torch.randperm(len(windows), generator=gen).tolist()
        for row in pack_windows([windows[i] for i in order], seq_len):
            drawn += 1
            if drawn > skip:
                yield build_row(shards, row)


def heldout_rows(shard: FeatureShard, categories: list[str], seq_len: int) -> list[Row]:
    """The held-out shard as rows of whole sequences (in order), with their categories."""
    windows = shard_windows([shard], seq_len)
    seq_of = [int(torch.searchsorted(shard.cu_seqlens, w[1], right=True)) - 1 for w in windows]
    rows, i = [], 0
    for packed in pack_windows(windows, seq_len):
        rows.append(build_row([shard], packed, [categories[seq_of[i + k]]
                                                for k in range(len(packed))]))
        i += len(packed)
    return rows
