"""Two methods of one bench run, compared after the fact: `speculant bench-pair FILE`.

The bench reports each method over plain (and a tuned method over its untuned twin); any other
pair, e.g. the chain with `eagle3` over the chain without it, ran side by side in the same run
too, prompt by prompt and repeat by repeat, so it pairs up from the JSON alone: per category
and concurrency, the median over repeats of the paired decode-rate ratios (the statistic every
speedup of the bench is) and its 95% interval from the same paired bootstrap over the prompts
(`confidence.paired_repeats_interval`; a JSON written before the per-repeat lists existed falls
back to the summed ones).
"""
from __future__ import annotations

import argparse
import json
import os

from speculant.bench.confidence import paired_ratio_interval, paired_repeats_interval
from speculant.bench.report import paired_speedup


def add_pair_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="a bench JSON (bench_out/bench-*.json or --json-out)")
    parser.add_argument("--base", required=True, help="the method divided by, e.g. ngram_mod,suffix")
    parser.add_argument("--method", required=True,
                        help="the method compared, e.g. ngram_mod,suffix,eagle3")
    parser.add_argument("--json", action="store_true", help="the rows as one JSON list on stdout")


def read_report(path: str) -> dict:
    """A bench JSON, or ValueError / FileNotFoundError naming what is wrong with it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"bench-pair: no such file: {path}")
    try:
        with open(path) as f:
            report = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"bench-pair: {path} is not JSON ({e})") from e
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise ValueError(f"bench-pair: {path} has no 'results' list: not a bench JSON")
    return report


def pair_methods(report: dict, base: str, method: str) -> list[dict]:
    """Per (category, concurrency) where both methods ran: `method`'s decode rate over `base`'s
    (the median of the paired repeats' ratios) and its 95% interval (None where the prompts do
    not pair up). ValueError naming the methods the report has when either is missing."""
    results = report["results"]
    methods = sorted({r.get("method") for r in results})
    for name in (base, method):
        if name not in methods:
            raise ValueError(f"bench-pair: method {name!r} is not in this run (it has: "
                             f"{', '.join(map(str, methods))})")
    by_key = {(r["category"], r["concurrency"], r["method"]): r for r in results}
    rows = []
    for r in results:
        if r["method"] != method or (r["category"], r["concurrency"], base) not in by_key:
            continue
        b = by_key[(r["category"], r["concurrency"], base)]
        rows.append({"category": r["category"], "concurrency": r["concurrency"],
                     "ratio": round(paired_speedup(r["repeats_decode_tok_s"],
                                                   b["repeats_decode_tok_s"]), 3),
                     "interval": _interval(r, b),
                     "base_speedup": b.get("speedup"), "method_speedup": r.get("speedup"),
                     "num_prompts": r.get("num_prompts")})
    return rows


def _interval(r: dict, b: dict) -> list[float] | None:
    if r.get("prompt_decode_repeats") and b.get("prompt_decode_repeats"):
        interval = paired_repeats_interval(_pairs(r["prompt_decode_repeats"]),
                                           _pairs(b["prompt_decode_repeats"]))
    elif r.get("prompt_decode") and b.get("prompt_decode"):
        interval = paired_ratio_interval([tuple(p) for p in r["prompt_decode"]],
                                         [tuple(p) for p in b["prompt_decode"]])
    else:
        interval = None
    return None if interval is None else [round(x, 3) for x in interval]


def _pairs(repeats: list) -> list[list[tuple]]:
    return [[tuple(p) for p in repeat] for repeat in repeats]


def pair_table(rows: list[dict], base: str, method: str) -> str:
    lines = [f"| category | conc | {method} / {base} | 95% CI | speedups over plain |",
             "|---|---|---|---|---|"]
    for row in rows:
        ci = "—" if row["interval"] is None else f"{row['interval'][0]:.3f}-{row['interval'][1]:.3f}"
        speedups = f"{row['base_speedup']}x -> {row['method_speedup']}x"
        lines.append(f"| {row['category']} | {row['concurrency']} | {row['ratio']:.3f} | {ci} | "
                     f"{speedups} |")
    return "\n".join(lines)


def run_pair(args) -> int:
    rows = pair_methods(read_report(args.file), args.base, args.method)
    if args.json:
        print(json.dumps(rows))
    else:
        print(pair_table(rows, args.base, args.method))
    return 0
