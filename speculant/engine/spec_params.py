"""Speculation parameters found by `speculant tune`, saved to a file that `generate`, `bench`
and `serve` load with `--spec-params FILE`.

Format (JSON, `speculant-spec-params/1`):
    {"format": "speculant-spec-params/1", "machine": {...}, "concurrency": 1,
     "methods": {"ngram_mod,suffix": {"spec_n_max": 8, "spec_p_min": 0.0,
                                      "decode_tok_s": 151.2, "speedup": 1.31}, ...}}
A method's entry is the best setting measured for that chain of speculators; `spec_n_max` 0
means plain decoding was fastest (speculation switched off for it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

FORMAT = "speculant-spec-params/1"


@dataclass(slots=True)
class SpecSetting:
    spec_n_max: int
    spec_p_min: float
    decode_tok_s: float = 0.0
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.spec_n_max <= 256:
            raise ValueError(f"spec params: spec_n_max must be in [0, 256], got {self.spec_n_max}")
        if not 0.0 <= self.spec_p_min <= 1.0:
            raise ValueError(f"spec params: spec_p_min must be in [0, 1], got {self.spec_p_min}")


def write_spec_params(path: str, methods: dict[str, SpecSetting], machine: dict,
                      concurrency: int) -> None:
    body = {"format": FORMAT, "machine": machine, "concurrency": concurrency,
            "methods": {name: {"spec_n_max": s.spec_n_max, "spec_p_min": s.spec_p_min,
                               "decode_tok_s": s.decode_tok_s, "speedup": s.speedup}
                        for name, s in methods.items()}}
    with open(path, "w") as f:
        json.dump(body, f, indent=1)


def read_spec_params(path: str) -> dict[str, SpecSetting]:
    """method name ('a,b') -> its setting; errors name the file and the problem."""
    try:
        with open(path) as f:
            body = json.load(f)
    except OSError as exc:
        raise FileNotFoundError(f"cannot read spec params file {path!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"spec params file {path!r} is not JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"spec params file {path!r}: expected format {FORMAT!r} "
                         f"(written by `speculant tune`)")
    try:
        return {name: SpecSetting(int(m["spec_n_max"]), float(m["spec_p_min"]),
                                  float(m.get("decode_tok_s", 0.0)), float(m.get("speedup", 1.0)))
                for name, m in body["methods"].items()}
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"spec params file {path!r}: malformed methods ({exc})") from exc


def setting_for(settings: dict[str, SpecSetting], spec_types: list[str]) -> SpecSetting | None:
    """The setting tuned for exactly this chain of speculators (order does not matter)."""
    key = frozenset(spec_types)
    for name, setting in settings.items():
        if frozenset(name.split(",")) == key:
            return setting
    return None
