"""Per-request parameters: how to sample, when to stop, and how to speculate."""
from __future__ import annotations

from dataclasses import dataclass, field

VERIFY_MODES = ("auto", "greedy", "match", "rejection")


@dataclass(slots=True)
class SpecParams:
    """Per-request speculation settings; None fields fall back to the engine's defaults."""

    enabled: bool = True
    types: list[str] | None = None  # subset of the engine's loaded speculators; None = all
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    # auto: greedy at temperature 0, otherwise sample-and-match (same output as plain decoding
    # with the same seed); rejection: Leviathan et al. rejection sampling with draft probs.
    verify: str = "auto"

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if self.n_max is not None and not 0 <= self.n_max <= 256:
            raise ValueError(f"n_max must be in [0, 256], got {self.n_max}")
        if self.n_min is not None and self.n_min < 0:
            raise ValueError(f"n_min must be >= 0, got {self.n_min}")
        if self.n_min is not None and self.n_max is not None and self.n_min > self.n_max > 0:
            raise ValueError(f"n_min ({self.n_min}) must not exceed n_max ({self.n_max})")
        if self.p_min is not None and not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"p_min must be in [0, 1], got {self.p_min}")
        if self.types is not None and not all(isinstance(t, str) and t for t in self.types):
            raise ValueError(f"types must be a list of speculator names, got {self.types!r}")


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping for one request (OpenAI semantics; temperature 0 = greedy)."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off; HF semantics over prompt + generated tokens
    seed: int | None = None  # same seed, same output; None = fresh entropy
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    spec: SpecParams = field(default_factory=SpecParams)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if self.spec is None:  # the engine's defaults, as an omitted field
            self.spec = SpecParams()
        elif isinstance(self.spec, dict):
            self.spec = SpecParams(**self.spec)
        elif not isinstance(self.spec, SpecParams):
            raise ValueError(f"spec must be SpecParams, a dict of its fields or None, "
                             f"got {type(self.spec).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
