"""Builds and loads the native CPU kernels (csrc/) as the torch operator library `speculant`.

The library is compiled from the package's own sources on first use, into
`$SPECULANT_CACHE_DIR` (default `~/.cache/speculant`) `/native/<key>/`, where the key hashes the
sources, the flags and the torch and Python versions; a file lock keeps two processes from
building at once, and later processes just load the result. `python -m speculant.kernels.native`
prebuilds it and prints where it lives.

The native path is off, and callers use the PyTorch fallback, when `SPECULANT_NATIVE=0`, when
the CPU lacks AVX2, FMA or F16C, or when the build fails (a warning says why).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# -ffp-contract=off: scalar code is never fused into FMAs behind our back, so the kernels' float
# operations are exactly the intrinsics written (their order is what batch invariance rests on).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname)


@torch.compiler.assume_constant_result  # torch.compile evaluates it once instead of tracing it
def native_available() -> bool:
    """True if the native kernels are loaded (building them now if needed) and usable here."""
    return load_ops() is not None


@functools.cache
def load_ops():
    """`torch.ops.speculant` with the native kernels registered, or None if they can't run here."""
    if os.environ.get("SPECULANT_NATIVE", "1") == "0":
        return None
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return None
    try:
        build()
    except Exception as exc:  # a missing compiler or headers must not stop inference
        warnings.warn(f"speculant native kernels unavailable ({type(exc).__name__}: {exc}); "
                      "using the PyTorch fallback", RuntimeWarning, stacklevel=2)
        return None
    _register_fakes()
    return torch.ops.speculant


def build() -> Path:
    """Compiles (or finds already compiled) and loads the library; returns its build directory."""
    from torch.utils import cpp_extension

    sources = sorted(CSRC.glob("*.cpp"))
    key = _build_key(sources + sorted(CSRC.glob("*.h")))
    build_dir = _cache_root() / "native" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(build_dir / "build.lock"):
        # torch's own marker of a build in progress; one left by a killed build would make every
        # later load wait forever, and while we hold the lock nobody else is building
        (build_dir / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=f"speculant_native_{key}", sources=[str(s) for s in sources],
            extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir), is_python_module=False, verbose=False)
    return build_dir


def _build_key(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    h.update(f"torch={torch.__version__} python={sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def _cache_root() -> Path:
    if "SPECULANT_CACHE_DIR" in os.environ:
        return Path(os.environ["SPECULANT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "speculant"


@contextlib.contextmanager
def _file_lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _register_fakes() -> None:
    """Shape-only implementations, so torch.compile can trace through the native operators."""

    @torch.library.register_fake("speculant::packed_linear")
    def _(x, weight, scales, mins, qtype, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("speculant::packed_embed")
    def _(ids, weight, scales, mins, qtype, out_features):
        in_features = weight.shape[1] * (1 if qtype in ("F32", "F16") else 32)
        return weight.new_empty(ids.shape[0], in_features, dtype=torch.float32)

    @torch.library.register_fake("speculant::paged_attention")
    def _(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale):
        return torch.empty_like(q)

    @torch.library.register_fake("speculant::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("speculant::add_rms_norm")
    def _(h, delta, weight, eps):
        return torch.empty_like(h)

    @torch.library.register_fake("speculant::silu_mul")
    def _(gate_up):
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @torch.library.register_fake("speculant::rope_write_kv")
    def _(qkv, bias, q_norm, k_norm, eps, cos, sin, positions, k_cache, v_cache, slot_mapping,
          num_heads):
        return qkv.new_empty(qkv.shape[0], num_heads, k_cache.shape[3])

    @torch.library.register_fake("speculant::decoder_stack")
    def _(h, stack, k_caches, v_caches, cos, sin, positions, slot_mapping, block_tables,
          token_seq, token_pos, final_norm, hidden_layers, num_heads, eps, scale):
        return torch.empty_like(h), [torch.empty_like(h) for _ in hidden_layers]


def main() -> None:
    start = time.perf_counter()
    if os.environ.get("SPECULANT_NATIVE", "1") == "0":
        print("SPECULANT_NATIVE=0: native kernels disabled")
        return
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        print(f"CPU lacks {', '.join(missing)}: the PyTorch fallback will be used")
        return
    build_dir = build()
    print(f"speculant native kernels ready in {build_dir} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
