"""Builds and loads the native CPU kernels (csrc/) as the torch operator library `speculant`.

The library is compiled from the package's own sources on first use, into
`$SPECULANT_CACHE_DIR` (default `~/.cache/speculant`) `/native/<key>/`, where the key hashes the
sources, the flags and the torch and Python versions; a file lock keeps two processes from
building at once, and later processes just load the result. `python -m speculant.kernels.native`
prebuilds it and prints where it lives.

The native path is off, and callers use the PyTorch fallback, when `SPECULANT_NATIVE=0`, when
the CPU lacks AVX2, FMA or F16C, or when the build fails (a warning says why).

Kernel paths: the block-type linear kernels and attention's inner loops exist for AVX2, AVX-512
VNNI and AMX-INT8 (`csrc/avx512/`, compiled apart with the AVX-512 and AMX flags so the rest of
the library still runs on AVX2-only CPUs). The library picks the best path the CPU supports when
it loads (AMX also needs the OS's leave, asked for then);
`SPECULANT_KERNEL_PATH=auto|avx2|avx512_vnni|amx_int8` forces one (a path the CPU lacks is an
error that names it). All paths give bit-identical outputs. `kernel_path()` reports the active
one. How far ahead the VNNI kernels prefetch weights is chosen from the CPU too
(`SPECULANT_PREFETCH_BLOCKS=0..64` forces it; `weight_prefetch_blocks()` reports it), and so
is from how many rows they run a region in wide row tiles (`SPECULANT_VNNI_WIDE_ROWS=2..4096`
forces it; `vnni_wide_rows()` reports it).
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
AVX512_SRC = CSRC / "avx512"
REQUIRED_CPU_FLAGS = ("avx2", "fma", "f16c")
# -ffp-contract=off: scalar code is never fused into FMAs behind our back, so the kernels' float
# operations are exactly the intrinsics written (their order is what batch invariance rests on).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)  # resolves to the libgomp torch already loaded (same soname)
# csrc/avx512/*.cpp: compiled into objects of their own with these flags and linked in; only
# called on CPUs that have the features (csrc/kernel_path.cpp). They include no torch headers.
# The AMX and BF16 flags only make the tile and bf16 intrinsics available (linear_amx.cpp,
# attention_amx.cpp); the compiler never emits those instructions from float code on its own,
# so the VNNI objects are unchanged by them.
AVX512_CFLAGS = ("-O3", "-std=c++17", "-fPIC", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off",
                 "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mamx-tile",
                 "-mamx-int8", "-mamx-bf16", "-mavx512bf16")
# what kernel_path() reports when the native kernels are not in use
FALLBACK_PATH = "torch"


def native_available() -> bool:
    """True if the native kernels are loaded (building them now if needed) and usable here."""
    return load_ops() is not None


# torch.compile evaluates it once instead of tracing it. This is all that
# `torch.compiler.assume_constant_result` does, but calling it imports torch._dynamo, 1.1 s of
# every process start (a third of `speculant generate`'s start-up before the model loads) for
# a compiler the engine never runs; tests/kernels: test_native_ops_compile_fullgraph.
native_available._dynamo_marked_constant = True


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
    torch.ops.speculant.kernel_path()  # applies SPECULANT_KERNEL_PATH now: a bad value raises here
    torch.ops.speculant.weight_prefetch_blocks()  # and SPECULANT_PREFETCH_BLOCKS
    torch.ops.speculant.vnni_wide_rows()  # and SPECULANT_VNNI_WIDE_ROWS
    torch.ops.speculant.prompt_attention()  # and SPECULANT_PROMPT_ATTENTION
    return torch.ops.speculant


def kernel_path() -> str:
    """The path the native linear kernels run on ("avx2", "avx512_vnni", "amx_int8"), or "torch"
    when the PyTorch fallback runs instead."""
    ops = load_ops()
    return ops.kernel_path() if ops is not None else FALLBACK_PATH


def weight_prefetch_blocks() -> int | None:
    """Weight blocks the VNNI and AVX2 kernels prefetch ahead (0: none; chosen from the CPU, or
    SPECULANT_PREFETCH_BLOCKS; csrc/kernel_path.h), or None without the native kernels."""
    ops = load_ops()
    return int(ops.weight_prefetch_blocks()) if ops is not None else None


def vnni_wide_rows() -> int | None:
    """The fewest rows for which the VNNI kernels run a region in wide row tiles (chosen from the
    CPU, or SPECULANT_VNNI_WIDE_ROWS; csrc/kernel_path.h), or None without the native kernels."""
    ops = load_ops()
    return int(ops.vnni_wide_rows()) if ops is not None else None


@contextlib.contextmanager
def _forced_setting(setter: str, value, what: str):
    """Runs the block with the process-wide native setting `setter` (an op that sets it and
    returns the previous value) at `value`, then restores the previous one."""
    ops = load_ops()
    if ops is None:
        raise RuntimeError(f"{what} requested but the native kernels are unavailable")
    set_value = getattr(ops, setter)
    previous = set_value(value)
    try:
        yield
    finally:
        set_value(previous)


def forced_prefetch_blocks(blocks: int):
    """Runs the block with the VNNI and AVX2 kernels prefetching `blocks` weight blocks ahead, then
    restores the previous setting (tests and A/B measurements)."""
    return _forced_setting("set_weight_prefetch_blocks", blocks, "weight prefetch distance")


def forced_vnni_wide_rows(rows: int):
    """Runs the block with the VNNI kernels taking wide row tiles from `rows` rows, then restores
    the previous setting (tests and A/B measurements)."""
    return _forced_setting("set_vnni_wide_rows", rows, "VNNI wide-row threshold")


def prompt_attention() -> str:
    """What attention runs prompt positions on: "amx_bf16" (tiles: an AMX-BF16 CPU on the
    amx_int8 path, unless SPECULANT_PROMPT_ATTENTION=fp32) or "fp32" (also without the native
    kernels)."""
    ops = load_ops()
    return str(ops.prompt_attention()) if ops is not None else "fp32"


def thread_team() -> str | None:
    """Who runs the native kernels' parallel chunks: "pool" (their own work-sharing pool, when
    OMP_WAIT_POLICY=passive or SPECULANT_POOL=1 was in the environment; kernels/thread_policy.py)
    or "openmp" (torch's OpenMP threads); None without the native kernels."""
    ops = load_ops()
    return str(ops.thread_team()) if ops is not None else None


def warm_in_background(tensors: list[torch.Tensor]) -> bool:
    """Starts the kernels' pool workers reading `tensors` (contiguous, on the CPU) into the
    caches while the calling thread goes on (csrc/pool.h: pool_warm); the next native kernel
    call ends what is left of it. False, nothing started, without the native kernels or their
    pool, or with one thread. For weights a burst of kernel calls is about to read after the
    target's forward has flushed them: a drafter head's first calls of a round."""
    ops = load_ops()
    return bool(ops.pool_warm(tensors)) if ops is not None and tensors else False


def tile_kv_cache() -> bool:
    """Whether attention runs natively over a bfloat16 KV cache in the AMX tiles' layout
    (kernels/kv_layout.py): a CPU with AVX512_BF16 (and AVX-512 VNNI), and the native kernels;
    on AMX-BF16 tiles where the CPU has them, else on AVX512_BF16 dot products
    (`kv_attention`)."""
    ops = load_ops()
    return bool(ops.tile_kv_cache()) if ops is not None else False


def kv_attention() -> str:
    """What a bfloat16 KV cache is attended on: "amx_bf16" (tiles, csrc/avx512/
    attention_tiles.cpp), "avx512_bf16" (dot products, attention_bf16dot.cpp: CPUs without AMX,
    or SPECULANT_KV_ATTENTION=avx512_bf16) or "none" (no bfloat16 cache runs natively here)."""
    ops = load_ops()
    return str(ops.kv_attention()) if ops is not None else "none"


def forced_kv_attention(mode: str):
    """Runs the block with a bfloat16 cache attended as `mode` says ("auto" or "avx512_bf16"),
    then restores the previous setting (tests and A/B measurements)."""
    return _forced_setting("set_kv_attention", mode, "KV attention mode")


def forced_prompt_attention(mode: str):
    """Runs the block with prompt attention `mode` ("auto" or "fp32"), then restores the
    previous setting (tests and A/B measurements)."""
    return _forced_setting("set_prompt_attention", mode, "prompt attention mode")


def supported_kernel_paths() -> tuple[str, ...]:
    """The kernel paths this CPU can run, best last (empty without the native kernels)."""
    ops = load_ops()
    return tuple(ops.kernel_paths()) if ops is not None else ()


def forced_kernel_path(name: str):
    """Runs the block on kernel path `name` (process-wide), then restores the previous one: how
    tests and benchmarks compare paths in one process. Raises if this CPU lacks the path."""
    return _forced_setting("set_kernel_path", name, f"kernel path {name!r}")


def build() -> Path:
    """Compiles (or finds already compiled) and loads the library; returns its build directory."""
    from torch.utils import cpp_extension

    sources = sorted(CSRC.glob("*.cpp"))
    key = _build_key(sorted(p for p in CSRC.rglob("*") if p.suffix in (".cpp", ".h")))
    build_dir = _cache_root() / "native" / key
    build_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(build_dir / "build.lock"):
        # torch's own marker of a build in progress; one left by a killed build would make every
        # later load wait forever, and while we hold the lock nobody else is building
        (build_dir / "lock").unlink(missing_ok=True)
        objects = [str(o) for o in _compile_avx512_objects(build_dir)]
        cpp_extension.load(
            name=f"speculant_native_{key}", sources=[str(s) for s in sources],
            extra_cflags=list(CFLAGS), extra_ldflags=objects + list(LDFLAGS),
            build_directory=str(build_dir), is_python_module=False, verbose=False)
    return build_dir


def _compile_avx512_objects(build_dir: Path) -> list[Path]:
    """csrc/avx512/*.cpp compiled with AVX512_CFLAGS (cpp_extension has one set of flags for all
    sources); the build key covers these sources and flags, so an object found is up to date."""
    from torch.utils import cpp_extension

    objects = []
    for src in sorted(AVX512_SRC.glob("*.cpp")):
        obj = build_dir / f"avx512_{src.stem}.o"
        if not obj.exists():
            tmp = obj.with_name(obj.name + ".tmp")
            cmd = [cpp_extension.get_cxx_compiler(), *AVX512_CFLAGS, "-I", str(CSRC), "-c",
                   str(src), "-o", str(tmp)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"compiling {src.name} failed:\n{done.stderr}")
            tmp.replace(obj)
        objects.append(obj)
    return objects


def _build_key(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(CSRC)).encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(CFLAGS + LDFLAGS + AVX512_CFLAGS).encode())
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

    @torch.library.register_fake("speculant::packed_linear_argmax")
    def _(x, weight, scales, mins, qtype, out_features):
        return x.new_empty(x.shape[0], out_features), x.new_empty(x.shape[0], dtype=torch.int64)

    @torch.library.register_fake("speculant::packed_embed")
    def _(ids, weight, scales, mins, qtype, out_features):
        in_features = weight.shape[1] * (1 if qtype in ("F32", "F16") else 32)
        return weight.new_empty(ids.shape[0], in_features, dtype=torch.float32)

    @torch.library.register_fake("speculant::paged_attention")
    def _(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale, prompt_lens=None):
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

    @torch.library.register_fake("speculant::row_argmax")
    def _(logits, with_prob=False):
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows if with_prob else 0)

    @torch.library.register_fake("speculant::sample_rows")
    def _(logits, uniforms, temperature, top_k, top_p, min_p, with_prob=False):
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows if with_prob else 0)

    @torch.library.register_fake("speculant::rope_write_kv")
    def _(qkv, bias, q_norm, k_norm, eps, cos, sin, positions, k_cache, v_cache, slot_mapping,
          num_heads):
        return qkv.new_empty(qkv.shape[0], num_heads, qkv.shape[1] // (num_heads + 2 * (
            v_cache.shape[1] if v_cache.dim() == 5 else v_cache.shape[2])))

    @torch.library.register_fake("speculant::decoder_stack")
    def _(h, stack, k_caches, v_caches, cos, sin, positions, slot_mapping, block_tables,
          token_seq, token_pos, final_norm, hidden_layers, num_heads, eps, scale,
          hidden_rows=None, prompt_lens=None):
        rows = h.shape[0] if hidden_rows is None else hidden_rows.shape[0]
        return torch.empty_like(h), [h.new_empty(rows, h.shape[1]) for _ in hidden_layers]

    @torch.library.register_fake("speculant::eagle3_layer")
    def _(embeds, hidden, weights, qtypes, out_features, cos, sin, positions, k_cache, v_cache,
          slot_mapping, block_tables, token_seq, token_pos, logits_rows, num_heads, eps, scale):
        rows = 0 if logits_rows is None else logits_rows.shape[0]
        return hidden.new_empty(hidden.shape, dtype=torch.float32), \
            hidden.new_empty(rows, out_features[4], dtype=torch.float32)


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
    print(f"speculant native kernels ready in {build_dir} ({time.perf_counter() - start:.1f} s); "
          f"kernel path {kernel_path()} (this CPU runs: {', '.join(supported_kernel_paths())}), "
          f"weight prefetch {weight_prefetch_blocks()} blocks ahead, VNNI wide row tiles from "
          f"{vnni_wide_rows()} rows")


if __name__ == "__main__":
    main()
