"""Prefill and plain decode, llama-bench style, optionally beside llama.cpp's llama-bench on the
same GGUF in the same run window.

    python -m speculant.bench.pp_tg [--model M] [--pp 512,3000] [--tg 128] [--repeats 3]
        [--paths amx_int8,avx512_vnni] [--threads N] [--llama-bench PATH] [--json-out FILE]
        [--kv-dtypes bfloat16,float16]

- `ppN`: a prompt of N token ids (seeded random ids, as llama-bench uses), one sequence, from an
  empty cache, generating one token: N / wall time.
- `tgN`: N tokens of plain greedy decoding after a 1-token prompt, EOS ignored. The prefill step
  is taken out as hf_peer does: N / (time(1 + N tokens) - time(1 token)).

Each repeat runs every kernel path of `--paths` (default: the active one; with `--kv-dtypes`, each
path once per KV cache type, engines sharing the weights, labelled `speculant:<path>:<kv>`) and
then llama-bench
(`-p <pp> -n <tg> -t <threads> -r 1 -o json`), the order reversed every repeat, so drift on a
shared machine hits them alike; the table and the JSON give medians and every run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

LLAMA_CPP = "llama.cpp"


@dataclass(slots=True)
class Options:
    model: str = "default"
    pp: tuple[int, ...] = (512, 3000)
    tg: int = 128
    repeats: int = 3
    paths: tuple[str, ...] = ()  # kernel paths; () = the active one
    threads: int = 0  # torch.set_num_threads and llama-bench -t; 0 = torch's default
    llama_bench: str = ""  # path of a llama-bench binary; "" = speculant only
    json_out: str = ""
    seed: int = 0
    kv_dtypes: tuple[str, ...] = ()  # KV cache element types, each its own engine; () = auto


@dataclass(slots=True)
class Cell:
    """One engine (a kernel path of ours, or llama.cpp) on one test: tok/s of every repeat."""
    engine: str
    test: str
    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)


def parse_args(argv: list[str] | None) -> Options:
    ap = argparse.ArgumentParser(prog="python -m speculant.bench.pp_tg",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--pp", default="512,3000", help="prompt lengths, comma-separated")
    ap.add_argument("--tg", type=int, default=128, help="decoded tokens (0: no decode test)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--paths", default="", help="kernel paths to run, comma-separated")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--llama-bench", default="", help="llama.cpp's llama-bench binary")
    ap.add_argument("--json-out", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-dtypes", default="",
                    help="KV cache element types to compare, comma-separated (engines sharing "
                         "the weights; default: auto alone)")
    a = ap.parse_args(argv)
    try:
        pp = tuple(int(v) for v in a.pp.split(",") if v.strip())
    except ValueError:
        ap.error(f"--pp must be comma-separated integers, got {a.pp!r}")
    if any(n < 1 for n in pp):
        ap.error(f"--pp lengths must be >= 1, got {a.pp!r}")
    if a.tg < 0:
        ap.error(f"--tg must be >= 0, got {a.tg}")
    if not pp and a.tg == 0:
        ap.error("nothing to measure: give --pp lengths or --tg > 0")
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    if a.threads < 0:
        ap.error(f"--threads must be >= 0, got {a.threads}")
    if a.llama_bench and not (os.path.isfile(a.llama_bench) and os.access(a.llama_bench, os.X_OK)):
        ap.error(f"--llama-bench {a.llama_bench!r} is not an executable file")
    paths = tuple(p for p in a.paths.split(",") if p.strip())
    kv_dtypes = tuple(k.strip() for k in a.kv_dtypes.split(",") if k.strip())
    from speculant.engine.kv_cache import KV_DTYPES

    bad = [k for k in kv_dtypes if k not in ("auto", *KV_DTYPES)]
    if bad:
        ap.error(f"--kv-dtypes: {', '.join(bad)} not one of auto, {', '.join(KV_DTYPES)}")
    return Options(a.model, pp, a.tg, a.repeats, paths, a.threads, a.llama_bench, a.json_out,
                   a.seed, kv_dtypes)


def random_prompt(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n token ids away from the special tokens at the ends of the vocabulary."""
    return [rng.randrange(100, vocab_size - 100) for _ in range(n)]


def time_ours(llm, opts: Options, rng: random.Random) -> dict[str, float]:
    """tok/s of each test on the active kernel path, one run each."""
    from speculant.engine.sampling_params import SamplingParams

    vocab_size = llm.engine.model_config.vocab_size
    first = SamplingParams(max_tokens=1, temperature=0.0, spec={"enabled": False})
    rates = {}
    for n in opts.pp:
        ids = random_prompt(rng, n, vocab_size)
        start = time.perf_counter()
        llm.generate([ids], first)
        rates[f"pp{n}"] = n / (time.perf_counter() - start)
    if opts.tg:
        ids = random_prompt(rng, 1, vocab_size)
        decode = SamplingParams(max_tokens=1 + opts.tg, temperature=0.0, ignore_eos=True,
                                spec={"enabled": False})
        start = time.perf_counter()
        llm.generate([ids], first)
        one = time.perf_counter() - start
        start = time.perf_counter()
        out = llm.generate([ids], decode)[0]
        whole = time.perf_counter() - start
        if len(out.token_ids) != 1 + opts.tg:
            raise RuntimeError(f"tg{opts.tg}: decoded {len(out.token_ids)} tokens")
        rates[f"tg{opts.tg}"] = opts.tg / max(whole - one, 1e-9)
    return rates


def llama_bench_command(opts: Options, model_path: str, threads: int) -> list[str]:
    cmd = [opts.llama_bench, "-m", model_path, "-t", str(threads), "-r", "1", "-o", "json"]
    cmd += ["-p", ",".join(map(str, opts.pp)) if opts.pp else "0"]
    cmd += ["-n", str(opts.tg)]
    return cmd


def parse_llama_bench(stdout: str) -> dict[str, float]:
    """llama-bench's `-o json` records -> {"pp512": tok/s, "tg128": tok/s}."""
    try:
        records = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise RuntimeError(f"llama-bench printed no JSON ({exc}): {stdout[:200]!r}") from None
    rates = {}
    for r in records:
        n_prompt, n_gen = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        test = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else None
        if test is not None:
            rates[test] = float(r["avg_ts"])
    return rates


def time_llama_cpp(opts: Options, model_path: str, threads: int) -> dict[str, float]:
    done = subprocess.run(llama_bench_command(opts, model_path, threads), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {done.returncode}): {done.stderr[-500:]}")
    return parse_llama_bench(done.stdout)


def measure(opts: Options) -> tuple[list[Cell], dict]:
    import torch

    from speculant.bench.timing import machine_info
    from speculant.kernels.native import forced_kernel_path, kernel_path
    from speculant.llm import LLM

    if opts.threads:
        torch.set_num_threads(opts.threads)
    threads = torch.get_num_threads()
    from speculant.engine.config import EngineConfig
    from speculant.engine.engine import Engine

    llm = LLM(model=opts.model, kv_dtype=(opts.kv_dtypes or ("auto",))[0])
    llms = {llm.engine.config.kv_dtype: llm}  # one engine per KV cache type, the weights shared
    for kv in opts.kv_dtypes[1:]:
        other = Engine(EngineConfig(model=opts.model, kv_dtype=kv), model_from=llm.engine)
        llms.setdefault(other.config.kv_dtype, LLM.from_engine(other))
    model_path = llm.engine.model_path
    if opts.llama_bench and not model_path.endswith(".gguf"):
        raise ValueError(f"--llama-bench needs a GGUF model; {model_path!r} is not one")
    paths = opts.paths or (kernel_path(),)
    engines = [f"speculant:{p}:{kv}" if opts.kv_dtypes else f"speculant:{p}"
               for p in paths for kv in llms] + ([LLAMA_CPP] if opts.llama_bench else [])
    cells: dict[tuple[str, str], Cell] = {}
    rng = random.Random(opts.seed)
    for r in range(opts.repeats):
        for engine in engines if r % 2 == 0 else engines[::-1]:
            if engine == LLAMA_CPP:
                rates = time_llama_cpp(opts, model_path, threads)
            else:  # the active path unless paths were asked for (an unknown one raises)
                _, path, *kv = engine.split(":")
                with forced_kernel_path(path) if opts.paths else contextlib.nullcontext():
                    rates = time_ours(llms[kv[0]] if kv else llm, opts, rng)
            for test, rate in rates.items():
                cells.setdefault((engine, test), Cell(engine, test)).runs.append(rate)
    meta = {"machine": machine_info(threads), "model": model_path, "repeats": opts.repeats,
            "llama_bench": opts.llama_bench or None}
    return list(cells.values()), meta


def table(cells: list[Cell]) -> str:
    tests = list(dict.fromkeys(c.test for c in cells))
    engines = list(dict.fromkeys(c.engine for c in cells))
    by = {(c.engine, c.test): c for c in cells}
    head = "| test | " + " | ".join(f"{e} tok/s" for e in engines) + " |"
    lines = [head, "|" + "---|" * (len(engines) + 1)]
    for t in tests:
        row = [f"{by[(e, t)].median:.1f}" if (e, t) in by else "—" for e in engines]
        lines.append(f"| {t} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        cells, meta = measure(opts)
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    m = meta["machine"]
    print(f"{m['cpu']}, {m['threads']} threads, model {os.path.basename(meta['model'])}, "
          f"median of {opts.repeats}")
    print(table(cells))
    result = {**meta, "results": [{"engine": c.engine, "test": c.test, "tok_s": c.median,
                                   "runs": c.runs} for c in cells]}
    if opts.json_out:
        with open(opts.json_out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
