"""Synthetic drafts for benchmarking the engine at chosen acceptance rates (llama.cpp's
`--spec-synth-*`): the drafter proposes `n_max` filler tokens and draws how many of them the
engine accepts, position i with conditional probability rates[i] (`Draft.forced_num_accepted`);
the engine accepts that many instead of verifying. Output text is therefore invalid; it
measures speed, never quality.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speculant.speculators.base import Draft, DraftRequest, Speculator, SpeculatorContext


@dataclass(slots=True)
class SyntheticConfig:
    """- rates: conditional acceptance of draft position i (the last rate repeats).
    - filler_token_id: the drafted token; -1 repeats each sequence's last token.
    - seed: of the draws (reproducible runs)."""

    rates: list[float] = field(default_factory=lambda: [0.0])
    filler_token_id: int = -1
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rates, (int, float)):
            self.rates = [float(self.rates)]
        if not self.rates or not all(0.0 <= r <= 1.0 for r in self.rates):
            raise ValueError(f"synthetic: rates must be a non-empty list in [0, 1], got {self.rates}")
        if self.filler_token_id < -1:
            raise ValueError(f"filler_token_id must be >= -1, got {self.filler_token_id}")


class SyntheticSpeculator(Speculator):
    name = "synthetic"
    config_class = SyntheticConfig

    def __init__(self, ctx: SpeculatorContext, config: SyntheticConfig | None = None):
        self.config = config or SyntheticConfig()
        if self.config.filler_token_id >= ctx.vocab_size:
            raise ValueError(f"filler_token_id {self.config.filler_token_id} outside the vocabulary")
        self._active: set[int] = set()
        self._rng = torch.Generator().manual_seed(self.config.seed)

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._active:
            raise ValueError(f"synthetic: sequence {seq_id} already begun")
        self._active.add(seq_id)

    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        out = {}
        for r in requests:
            tok = self.config.filler_token_id if self.config.filler_token_id >= 0 else r.token_ids[-1]
            n = r.params.n_max
            if n > 0:
                uniforms = torch.rand(n, generator=self._rng).tolist()
                out[r.seq_id] = Draft([tok] * n, expected_accepted=float(n),
                                      forced_num_accepted=synthetic_num_accepted(
                                          self.config.rates, n, uniforms))
        return out

    def accept(self, seq_id: int, num_accepted: int, is_other: bool) -> None:
        pass

    def end(self, seq_id: int) -> None:
        self._active.discard(seq_id)


def synthetic_num_accepted(rates: list[float], draft_len: int, uniforms: list[float]) -> int:
    """Accept position i while uniforms[i] < rates[i] (the last rate repeats past the list)."""
    n = 0
    for i in range(draft_len):
        rate = rates[min(i, len(rates) - 1)] if rates else 0.0
        if uniforms[i] >= rate:
            break
        n += 1
    return n
