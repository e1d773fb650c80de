"""Trustworthy timing on a shared machine: CPU counters around every measurement.

A 2-core VM drifts ±15% between runs, and other users' processes are invisible to `ps` inside
our container but not to the kernel's machine-wide counters. Around each measurement we read

- wall time (`time.perf_counter`) and this process's CPU time (`time.process_time`, all threads);
- `/proc/stat`: busy and steal time of the whole machine, all cores (Linux only);
- `os.getloadavg()` (a 1-minute moving average; a slow signal, kept for the record).

Vocabulary (`CpuUsage`):
- *own_cpu_util*: our CPU time / (wall time x our threads), the share of the cores we asked for
  that we actually used (spinning OpenMP workers count as used).
- *other_cpu_cores*: (machine busy time - our CPU time) / wall time, the average number of cores
  other processes (and the hypervisor's steal) took while we measured.
- *interference*: other_cpu_cores above a tolerance (default 0.25 of a core). Without
  `/proc/stat` the load average stands in: load above our own threads counts as others' cores.

The verdict is a pure function of two `CpuSample`s (`cpu_usage`), so it is tested on fake
counters; `watch` and `run_with_reruns` wrap a measurement with it.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, TypeVar

T = TypeVar("T")

DEFAULT_TOLERANCE_CORES = 0.25
# Counter resolution: /proc/stat ticks are 10 ms per core, so a measurement needs a floor below
# which others' time is noise (two ticks on each of two cores).
_MIN_OTHER_CPU_S = 0.04


@dataclass(frozen=True, slots=True)
class CpuSample:
    wall_s: float  # time.perf_counter()
    process_cpu_s: float  # time.process_time(): user + system time of all our threads
    machine_busy_s: float | None  # /proc/stat, all cores: every state but idle and iowait
    machine_steal_s: float | None  # /proc/stat, all cores: time the hypervisor gave to others
    loadavg_1m: float | None


@dataclass(frozen=True, slots=True)
class CpuUsage:
    wall_s: float
    own_cpu_s: float
    own_cpu_util: float
    other_cpu_cores: float
    steal_cores: float
    load_before: float | None
    load_after: float | None
    interference: bool
    reason: str  # empty when there was no interference

    def to_dict(self) -> dict:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def read_proc_stat(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy seconds, steal seconds) summed over all cores, or None where /proc/stat is absent."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    ticks = [int(x) for x in fields[1:9]]
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    idle = ticks[3] + ticks[4]
    return (sum(ticks) - idle) / hz, ticks[7] / hz


def sample() -> CpuSample:
    machine = read_proc_stat()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return CpuSample(wall_s=time.perf_counter(), process_cpu_s=time.process_time(),
                     machine_busy_s=machine[0] if machine else None,
                     machine_steal_s=machine[1] if machine else None, loadavg_1m=load)


def cpu_usage(before: CpuSample, after: CpuSample, threads: int,
              tolerance_cores: float = DEFAULT_TOLERANCE_CORES) -> CpuUsage:
    """What happened on the machine between two samples, and whether others interfered."""
    wall = max(after.wall_s - before.wall_s, 1e-9)
    own = max(after.process_cpu_s - before.process_cpu_s, 0.0)
    steal = 0.0
    if before.machine_busy_s is not None and after.machine_busy_s is not None:
        other_s = max(after.machine_busy_s - before.machine_busy_s - own, 0.0)
        steal = max(after.machine_steal_s - before.machine_steal_s, 0.0) / wall
        other = other_s / wall if other_s > _MIN_OTHER_CPU_S else 0.0
        source = "/proc/stat"
    else:
        loads = [x for x in (before.loadavg_1m, after.loadavg_1m) if x is not None]
        other = max(max(loads) - threads, 0.0) if loads else 0.0
        source = "load average"
    interference = other > tolerance_cores
    reason = (f"other processes used {other:.2f} cores on average ({source}; steal {steal:.2f})"
              if interference else "")
    return CpuUsage(wall_s=wall, own_cpu_s=own, own_cpu_util=own / (wall * max(threads, 1)),
                    other_cpu_cores=other, steal_cores=steal, load_before=before.loadavg_1m,
                    load_after=after.loadavg_1m, interference=interference, reason=reason)


def watch(fn: Callable[[], T], threads: int,
          tolerance_cores: float = DEFAULT_TOLERANCE_CORES) -> tuple[T, CpuUsage]:
    """Run `fn` once between two CPU samples."""
    before = sample()
    result = fn()
    return result, cpu_usage(before, sample(), threads, tolerance_cores)


def run_with_reruns(fn: Callable[[], T], threads: int, max_reruns: int, label: str,
                    tolerance_cores: float = DEFAULT_TOLERANCE_CORES,
                    warn: Callable[[str], None] | None = None) -> tuple[T, CpuUsage, int]:
    """Run `fn`; while others interfered and reruns remain, run it again. Returns the last
    result, its CPU usage and the number of reruns. Every interfered run is reported to `warn`."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr, flush=True))
    for attempt in range(max_reruns + 1):
        result, usage = watch(fn, threads, tolerance_cores)
        if not usage.interference:
            return result, usage, attempt
        action = "re-running" if attempt < max_reruns else "kept, flagged in the JSON"
        warn(f"warning: interference during {label}: {usage.reason}; {action}")
    return result, usage, max_reruns


def spread(values: list[float]) -> dict:
    """min / median / max of repeated measurements (empty list -> zeros)."""
    if not values:
        return {"min": 0.0, "median": 0.0, "max": 0.0}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def machine_info(threads: int) -> dict:
    """What the README's table needs to say where it was measured. `kernel_path`: the path the
    CPU linear kernels ran on ("avx2", "avx512_vnni", "amx_int8"; "torch" for the PyTorch
    fallback); `prefetch_blocks`: how far ahead the VNNI and AVX2 kernels prefetched weights (None
    without the native kernels); `vnni_wide_rows`: from how many rows the VNNI kernels ran a
    region in wide row tiles (None without the native kernels); `prompt_attention`: what prompt positions were attended on
    ("amx_bf16" tiles or "fp32"); `kv_attention`: what a bfloat16 KV cache is attended on
    ("amx_bf16" tiles, "avx512_bf16" dot products, "none"); `thread_team`: who ran the kernels' parallel chunks ("pool" or
    "openmp", kernels/thread_policy.py; None without the native kernels)."""
    import torch

    from speculant.kernels.native import (kernel_path, kv_attention, prompt_attention,
                                          thread_team, vnni_wide_rows, weight_prefetch_blocks)

    return {"cpu": _cpu_model(), "num_cpus": os.cpu_count() or 0, "threads": threads,
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "kernel_path": kernel_path(),
            "prefetch_blocks": weight_prefetch_blocks(), "vnni_wide_rows": vnni_wide_rows(),
            "prompt_attention": prompt_attention(),
            "kv_attention": kv_attention(), "thread_team": thread_team()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
