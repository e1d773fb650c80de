"""The speculator registry: every built-in drafter by name, plus any registered at run time.

Built-ins are a static table of `name -> "module:Class"` imported on first use, so the registry
imports no speculator module up front (no import cycle with the modules that define them, and
`--help` stays cheap). A name whose module is missing or broken is an error naming it, never a
silently absent speculator. Third-party drafters call `register(cls)`.
"""
from __future__ import annotations

import importlib

from speculant.speculators.base import Speculator

BUILTIN_SPECULATORS: dict[str, str] = {
    "ngram_simple": "speculant.speculators.ngram_simple:NgramSimpleSpeculator",
    "ngram_map_k": "speculant.speculators.ngram_map:NgramMapKSpeculator",
    "ngram_map_k4v": "speculant.speculators.ngram_map:NgramMapK4vSpeculator",
    "ngram_mod": "speculant.speculators.ngram_mod:NgramModSpeculator",
    "ngram_cache": "speculant.speculators.ngram_cache:NgramCacheSpeculator",
    "suffix": "speculant.speculators.suffix:SuffixSpeculator",
    "draft": "speculant.speculators.draft_model:DraftModelSpeculator",
    "eagle3": "speculant.speculators.eagle3:Eagle3Speculator",
    "mtp": "speculant.speculators.mtp:MtpSpeculator",
    "synthetic": "speculant.speculators.synthetic:SyntheticSpeculator",
}


class SpeculatorRegistry:
    """Name -> speculator class; built-ins resolved lazily, extra classes added by `register`."""

    def __init__(self, builtin: dict[str, str]):
        self._paths = dict(builtin)
        self._classes: dict[str, type[Speculator]] = {}

    def register(self, cls: type[Speculator]) -> type[Speculator]:
        if not cls.name:
            raise ValueError(f"{cls.__qualname__} has no name")
        known = self._classes.get(cls.name)
        if cls.name in self._paths or (known is not None and known is not cls):
            raise ValueError(f"speculator {cls.name!r} registered twice")
        self._classes[cls.name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove a class added by `register` (built-ins stay)."""
        if name in self._paths:
            raise ValueError(f"speculator {name!r} is built in")
        self._classes.pop(name, None)

    def names(self) -> list[str]:
        return sorted(set(self._paths) | set(self._classes))

    def get(self, name: str) -> type[Speculator]:
        if name in self._classes:
            return self._classes[name]
        if name not in self._paths:
            raise ValueError(f"unknown speculator type {name!r}; known: {', '.join(self.names())}")
        module_name, _, class_name = self._paths[name].partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        if cls.name != name:
            raise RuntimeError(f"registry: {self._paths[name]} is named {cls.name!r}, not {name!r}")
        self._classes[name] = cls
        return cls


# The process-wide registry: speculators are code, not state, so one table serves every engine.
REGISTRY = SpeculatorRegistry(BUILTIN_SPECULATORS)


def register(cls: type[Speculator]) -> type[Speculator]:
    """Make a (third-party) speculator class available by its `name`."""
    return REGISTRY.register(cls)


def unregister(name: str) -> None:
    REGISTRY.unregister(name)


def registered_names() -> list[str]:
    return REGISTRY.names()


def speculator_class(name: str) -> type[Speculator]:
    return REGISTRY.get(name)
