"""Compute kernels: compact-weight linear layers, paged attention, and the small fused operators of
a decoder layer (RMSNorm, RoPE with the KV cache write, SiLU gate), and greedy picks over logits.

Each operation has a native CPU path (C++ in csrc/, built on first use by `native.py`: AVX2, and
AVX-512 VNNI linear and attention loops picked at run time where the CPU has them, with
bit-identical results; batch-invariant: a row's result never depends on what else is in the
batch) and a pure-PyTorch fallback used on other devices, with `SPECULANT_NATIVE=0`, or where the
extension can't be built.
`decoder.py` runs a model's whole layer stack in one native call.

Threads: the native kernels use torch.get_num_threads() threads, from their own work-sharing pool
when OMP_WAIT_POLICY=passive is set before torch is imported (robust when other processes share
the cores), else from torch's OpenMP threads; SPECULANT_POOL=1 / 0 forces either (csrc/pool.h).
"""
import importlib

__all__ = ["PackedLinear", "add_rms_norm", "native_available", "paged_attention", "rms_norm",
           "rope_cos_sin", "rope_write_kv", "row_argmax", "silu_mul"]

_EXPORTS = {
    "PackedLinear": "speculant.kernels.packed_linear",
    "native_available": "speculant.kernels.native",
    "paged_attention": "speculant.kernels.attention",
    "rms_norm": "speculant.kernels.rowwise",
    "add_rms_norm": "speculant.kernels.rowwise",
    "silu_mul": "speculant.kernels.rowwise",
    "rope_cos_sin": "speculant.kernels.rope",
    "rope_write_kv": "speculant.kernels.rope",
    "row_argmax": "speculant.kernels.argmax",
}


def __getattr__(name: str):
    # Exports resolve on first use so that importing the package does not import `native`:
    # `python -m speculant.kernels.native` would otherwise run a second copy of that module.
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
