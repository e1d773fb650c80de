"""Which threads run the native kernels' parallel chunks, chosen before torch loads libgomp.

The kernels split work between their own work-sharing pool and torch's OpenMP threads
(csrc/pool.h says why both exist): the pool is safe only where libgomp's idle threads sleep at
once (OMP_WAIT_POLICY=passive), else they spin for milliseconds on the core the pool's worker
needs. libgomp reads the variable when torch is imported, so it can only be set before that.

Measured on an Intel Xeon with AMX (`lscpu` "Intel(R) Xeon(R) Processor", model 207, 2 threads,
2026-12-06, `speculant bench` runs of each setting alternated in both orders): the pool decoded
greedy c=1 prompts 2-5% faster (mt_bench plain 368 / 374 / 375 tok/s against 356 / 364 / 356,
the chain ngram_mod,suffix 453 / 458 / 455 against 433 / 443 / 434), tg128 420 / 421 against
398 / 409, and tied at temperature 0.8 (pool / OpenMP 0.97-1.05 with the run order), at c=8
(0.92-1.12 over four pairs, 1.02 on average) and on 512- and 3000-token prompts. On an AMD EPYC
(Zen 1) it tied end to end (docs/kernels.md). So the `speculant` command sets
OMP_WAIT_POLICY=passive unless the user chose: Python programs that import torch first keep
torch's OpenMP threads (set the variable before importing torch to get the pool).
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping


def prefer_kernel_pool(environ: MutableMapping[str, str], modules: Mapping[str, object]) -> bool:
    """Set OMP_WAIT_POLICY=passive in `environ` (the kernels then run on their pool) unless
    the user set OMP_WAIT_POLICY, asked for torch's threads (SPECULANT_POOL=0), or torch is
    already in `modules` (libgomp has read the environment: the pool beside spinning OpenMP
    threads is the slow case). Returns whether it set the variable."""
    if "OMP_WAIT_POLICY" in environ or environ.get("SPECULANT_POOL") == "0" or "torch" in modules:
        return False
    environ["OMP_WAIT_POLICY"] = "passive"
    return True
