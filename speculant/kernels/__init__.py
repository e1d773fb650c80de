"""Compute kernels: compact-weight linear layers and paged attention.

Each operation has a native CPU path (C++/AVX2 in csrc/, built on first use by `native.py`;
batch-invariant: a row's result never depends on what else is in the batch) and a pure-PyTorch
fallback used on other devices, with `SPECULANT_NATIVE=0`, or where the extension can't be built.
"""
import importlib

__all__ = ["PackedLinear", "native_available", "paged_attention"]

_EXPORTS = {
    "PackedLinear": "speculant.kernels.packed_linear",
    "native_available": "speculant.kernels.native",
    "paged_attention": "speculant.kernels.attention",
}


def __getattr__(name: str):
    # Exports resolve on first use so that importing the package does not import `native`:
    # `python -m speculant.kernels.native` would otherwise run a second copy of that module.
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
