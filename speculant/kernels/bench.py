"""Micro-benchmark of the kernels at SmolLM2-135M's shapes: µs per call (median).

    python -m speculant.kernels.bench [--ms 1,4,8,16] [--budget 0.1] [--threads N]
                                      [--paths avx2,avx512_vnni,amx_int8] [--context 128]
                                      [--kv_dtype float32] [--block_size 0] [--copies 30]

For each weight matrix: the native kernel at every M (on the active kernel path, and on each
of `--paths` as `<path>_m<M>`), the PyTorch fallback at M=1, and fp32 `F.linear` (MKL) on the
dequantized weight for reference; then paged attention over a `--context`-token cache. The last stdout
line is one JSON object with every number, the CPU model and the active kernel path.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from speculant.bench.timing import machine_info
from speculant.kernels import PackedLinear, native_available, paged_attention
from speculant.kernels.kv_layout import TILE_BLOCK, check_tile_shape, k_cache_shape, v_cache_shape
from speculant.kernels.native import forced_kernel_path

# (name, out_features, in_features, qtype) as SmolLM2-135M-Instruct Q4_1 GGUF runs them
SHAPES = (
    ("qkv", 960, 576, "Q4_1"),
    ("attn_output", 576, 576, "Q4_1"),
    ("gate_up", 3072, 576, "Q4_1"),
    ("down", 576, 1536, "Q4_1"),
    ("lm_head", 49152, 576, "Q8_0"),
)


@dataclass(slots=True)
class BenchConfig:
    ms: str = "1,4,8,16"  # activation rows (tokens) per call
    budget: float = 0.1  # seconds of timed calls per cell
    threads: int = 0  # torch.set_num_threads; 0 keeps torch's default
    context: int = 128  # attention: KV positions before the query tokens
    paths: str = ""  # kernel paths to time the kernels on as well (comma-separated)
    kv_dtype: str = "float32"  # attention: the KV cache's dtype (float32, float16, bfloat16)
    block_size: int = 0  # attention: positions per cache block; 0 = the cache's own (16, 32 for
    # bfloat16, whose tiles' layout needs a multiple of 32 dividing 256)
    # linear: calls cycle through this many copies of each matrix under 8 MB, so its weights
    # come from L3 or DRAM as a model's layers do (30: SmolLM2-135M's), not from L2
    copies: int = 1

    def __post_init__(self):
        if not self.row_counts or min(self.row_counts) < 1:
            raise ValueError(f"--ms must list positive row counts, got {self.ms!r}")
        if self.copies < 1:
            raise ValueError(f"--copies must be at least 1, got {self.copies}")
        if self.budget <= 0:
            raise ValueError(f"--budget must be positive, got {self.budget}")
        if self.kv_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"--kv_dtype must be float32, float16 or bfloat16 (the tiles' "
                             f"layout), got {self.kv_dtype!r}")
        if self.block_size == 0:
            self.block_size = TILE_BLOCK if self.kv_dtype == "bfloat16" else 16
        if self.block_size < 1:
            raise ValueError(f"--block_size must be positive (0: the cache's own), got "
                             f"{self.block_size}")
        if self.kv_dtype == "bfloat16":
            try:  # refused here, not after minutes of timing the linears
                check_tile_shape(self.block_size, 64)  # SmolLM2-135M's head_dim
            except ValueError as exc:
                raise ValueError(f"--block_size {self.block_size} with --kv_dtype bfloat16: "
                                 f"{exc}") from None

    @property
    def row_counts(self) -> list[int]:
        return [int(m) for m in self.ms.split(",") if m]

    @property
    def kernel_paths(self) -> list[str]:
        return [p for p in self.paths.split(",") if p]


def median_us(fn, budget: float) -> float:
    """Median wall time of fn() in µs, over as many calls as fit in `budget` seconds (>= 5)."""
    fn()  # warm-up (first-call allocation, page faults)
    start = time.perf_counter()
    fn()
    reps = max(5, int(budget / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def bench_linear(cfg: BenchConfig) -> list[dict]:
    rows = []
    for name, out_features, in_features, qtype in SHAPES:
        w = PackedLinear.from_float(torch.randn(out_features, in_features) * 0.05, qtype)
        dense = w.dequantize()  # [out, in]
        small = out_features * in_features < (8 << 20)  # bytes of int8, a bound on the packed size
        copies = [w] + [PackedLinear.from_float(torch.randn(out_features, in_features) * 0.05, qtype)
                        for _ in range(cfg.copies - 1 if small else 0)]
        row = {"shape": name, "out": out_features, "in": in_features, "qtype": qtype}
        for m in cfg.row_counts:
            x = torch.randn(m, in_features)
            rotation = itertools.cycle(copies)
            if native_available():
                row[f"native_m{m}"] = median_us(lambda: next(rotation)(x), cfg.budget)
            for path in cfg.kernel_paths:
                with forced_kernel_path(path):
                    row[f"{path}_m{m}"] = median_us(lambda: next(rotation)(x), cfg.budget)
            row[f"fp32_m{m}"] = median_us(lambda: F.linear(x, dense), cfg.budget)
        x1 = torch.randn(1, in_features)
        row["fallback_m1"] = median_us(lambda: w(x1, native=False), cfg.budget)
        rows.append(row)
    return rows


def bench_attention(cfg: BenchConfig) -> dict:
    heads, kv_heads, head_dim, block_size = 9, 3, 64, cfg.block_size
    row = {"shape": f"attention ctx={cfg.context}", "kv_dtype": cfg.kv_dtype}
    for m in cfg.row_counts:
        length = cfg.context + m
        num_blocks = -(-length // block_size)
        dtype = getattr(torch, cfg.kv_dtype)
        k_cache = torch.randn(k_cache_shape(num_blocks, block_size, kv_heads, head_dim,
                                            dtype)).to(dtype)
        v_cache = torch.randn(v_cache_shape(num_blocks, block_size, kv_heads, head_dim,
                                            dtype)).to(dtype)
        tables = torch.randperm(num_blocks, dtype=torch.int32)[None]  # [1, num_blocks]
        q = torch.randn(m, heads, head_dim)
        seq = torch.zeros(m, dtype=torch.int32)
        pos = torch.arange(cfg.context, length, dtype=torch.int32)
        args = (q, k_cache, v_cache, tables, seq, pos, head_dim ** -0.5)
        if native_available():
            row[f"native_m{m}"] = median_us(lambda: paged_attention(*args), cfg.budget)
        for path in cfg.kernel_paths:
            with forced_kernel_path(path):
                row[f"{path}_m{m}"] = median_us(lambda: paged_attention(*args), cfg.budget)
        row[f"fallback_m{m}"] = median_us(lambda: paged_attention(*args, native=False),
                                          cfg.budget)
    return row


def print_table(rows: list[dict], ms: list[int], paths: list[str]) -> None:
    cols = [f"native_m{m}" for m in ms] + [f"{p}_m{m}" for p in paths for m in ms]
    cols += [f"fp32_m{m}" for m in ms] + ["fallback_m1"]
    cols += [f"fallback_m{m}" for m in ms if m != 1]
    cols = [c for c in cols if any(c in r for r in rows)]
    print(f"{'shape':<22}" + "".join(f"{c:>14}" for c in cols))
    for r in rows:
        label = f"{r['shape']} {r.get('qtype', '')}".strip()
        cells = "".join(f"{r[c]:>14.1f}" if c in r else f"{'':>14}" for c in cols)
        print(f"{label:<22}{cells}")


def parse_args() -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(BenchConfig):
        parser.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
    return BenchConfig(**vars(parser.parse_args()))


def main() -> None:
    cfg = parse_args()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)
    rows = bench_linear(cfg) + [bench_attention(cfg)]
    machine = machine_info(torch.get_num_threads())
    print(f"µs per call (median), {machine['cpu']}, {machine['threads']} threads, "
          f"native={'yes' if native_available() else 'no'}, kernel path {machine['kernel_path']}")
    print_table(rows, cfg.row_counts, cfg.kernel_paths)
    print(json.dumps({"threads": machine["threads"], "native": native_available(),
                      "cpu": machine["cpu"], "kernel_path": machine["kernel_path"],
                      "vnni_wide_rows": machine["vnni_wide_rows"], "results": rows}))


if __name__ == "__main__":
    main()
