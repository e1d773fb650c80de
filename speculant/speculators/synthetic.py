"""Synthetic drafts for benchmarking the engine at chosen acceptance rates (llama.cpp's
`--spec-synth-*`): the drafter proposes `n_max` filler tokens and the engine, configured with
`spec_synth_rates`, accepts draft position i with conditional probability rates[i] instead of
verifying. Output text is therefore invalid; it measures speed, never quality.
"""
from __future__ import annotations

from dataclasses import dataclass

from speculant.spec.base import Draft, DraftRequest, Speculator, SpeculatorContext, register


@dataclass(slots=True)
class SyntheticConfig:
    filler_token_id: int = -1  # -1: repeat each sequence's last token

    def __post_init__(self) -> None:
        if self.filler_token_id < -1:
            raise ValueError(f"filler_token_id must be >= -1, got {self.filler_token_id}")


@register
class SyntheticSpeculator(Speculator):
    name = "synthetic"
    config_class = SyntheticConfig

    def __init__(self, ctx: SpeculatorContext, config: SyntheticConfig | None = None):
        self.config = config or SyntheticConfig()
        if self.config.filler_token_id >= ctx.vocab_size:
            raise ValueError(f"filler_token_id {self.config.filler_token_id} outside the vocabulary")
        self._active: set[int] = set()

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        if seq_id in self._active:
            raise ValueError(f"synthetic: sequence {seq_id} already begun")
        self._active.add(seq_id)

    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        out = {}
        for r in requests:
            tok = self.config.filler_token_id if self.config.filler_token_id >= 0 else r.token_ids[-1]
            if r.params.n_max > 0:
                out[r.seq_id] = Draft([tok] * r.params.n_max,
                                      expected_accepted=float(r.params.n_max))
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
