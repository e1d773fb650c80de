"""Importing this module registers every built-in speculator (each module registers itself)."""
import importlib

_BUILTIN_MODULES = (
    "ngram_simple", "ngram_map", "ngram_mod", "ngram_cache", "suffix", "synthetic", "draft_model",
)

for _module in _BUILTIN_MODULES:
    try:
        importlib.import_module(f"speculant.spec.{_module}")
    except ModuleNotFoundError as exc:  # a module not written yet is simply not registered
        if exc.name != f"speculant.spec.{_module}":
            raise
