"""A draft's proposal vocabulary: the tokens its LM head is restricted to.

On a CPU the LM head dominates a small draft's step: SmolLM2's is 49152 x 576, ~1.2 ms per
drafted position at Q8_0, against ~0.3 ms for four decoder layers. Like EAGLE-3's reduced draft
vocabulary, a draft may score only the N tokens the target most often generates; a token outside
them is simply never proposed (the draft distribution q is zero there, so rejection sampling stays
lossless, and greedy verification never depended on q).

The ranking comes from data: `speculant distill` counts the target's generated tokens in its
training data and writes them, most frequent first, to `draft_vocab.json` in the draft folder.
"""
from __future__ import annotations

import json
import os

import torch

DRAFT_VOCAB_FILE = "draft_vocab.json"


def rank_tokens(token_ids: torch.Tensor, vocab_size: int) -> tuple[list[int], list[int]]:
    """token_ids [N] int -> (ids seen, most frequent first (ties by id), their counts)."""
    counts = torch.bincount(token_ids.long().flatten(), minlength=vocab_size)[:vocab_size]
    order = sorted((i for i in range(vocab_size) if counts[i] > 0), key=lambda i: (-int(counts[i]), i))
    return order, [int(counts[i]) for i in order]


def write_draft_vocab(folder: str, token_ids: torch.Tensor, vocab_size: int, source: str) -> str:
    ranked, counts = rank_tokens(token_ids, vocab_size)
    path = os.path.join(folder, DRAFT_VOCAB_FILE)
    with open(path, "w") as f:
        json.dump({"source": source, "num_tokens": int(token_ids.numel()),
                   "ranked_ids": ranked, "counts": counts}, f)
    return path


def read_ranking(folder: str) -> list[int]:
    path = os.path.join(folder, DRAFT_VOCAB_FILE) if os.path.isdir(folder) else ""
    if not path or not os.path.isfile(path):
        raise FileNotFoundError(f"draft: lm_head_tokens needs {DRAFT_VOCAB_FILE} in the draft "
                                f"folder {folder!r} (speculant distill writes it)")
    with open(path) as f:
        return [int(i) for i in json.load(f)["ranked_ids"]]


def head_token_ids(ranking: list[int], num_tokens: int, vocab_size: int,
                   always: frozenset[int] = frozenset()) -> torch.Tensor:
    """The first `num_tokens` ids of `ranking` below `vocab_size`, plus `always` (EOS, so the
    draft can still predict the end), completed in id order when the ranking is short; sorted,
    [n] int64."""
    chosen = {i for i in always if i < vocab_size}
    for i in ranking:
        if len(chosen) >= num_tokens:
            break
        if 0 <= i < vocab_size:
            chosen.add(i)
    i = 0
    while len(chosen) < min(num_tokens, vocab_size):
        chosen.add(i)
        i += 1
    return torch.tensor(sorted(chosen), dtype=torch.long)
