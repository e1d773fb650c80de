"""`speculant tune`: search draft limits offline on a prompt set, print what it measured and
write a parameters file (`--spec-params FILE` for generate, bench and serve).

For every chain of `--spec-type "a,b;c"` and every (n_max, p_min) of the grids, the prompts run
at `--concurrency` with that setting as their per-request draft limits (one engine, one model
load; speculator state fresh for every run), and decode tokens/s is measured; plain decoding
runs first and between settings as the baseline. The best setting per chain is written; n_max 0
means plain decoding won.
"""
from __future__ import annotations

import sys
import time

from speculant.cli.options import engine_options
from speculant.engine.spec_params import SpecSetting, write_spec_params


def add_tune_args(p) -> None:
    g = p.add_argument_group("tune")
    g.add_argument("--prompts", required=True, help="JSONL prompt file (shared/data schema)")
    g.add_argument("--categories", default=None, help="comma-separated categories of --prompts")
    g.add_argument("--limit", type=int, default=4, help="prompts per category")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--concurrency", type=int, default=1, help="sequences decoded together")
    g.add_argument("--grid", default="1,2,4,8,16", help="draft limits tried (n_max)")
    g.add_argument("--p-min-grid", default="0.0", help="confidence cut-offs tried (p_min)")
    g.add_argument("--out", default="spec_params.json", help="parameters file written")


def run_tune(args) -> int:
    from speculant.bench.options import parse_method_specs
    from speculant.bench.timing import machine_info
    from speculant.data.prompt_set import first_turn_prompt, read_prompts
    from speculant.llm import LLM

    grid, p_grid = _ints(args.grid, "--grid"), _floats(args.p_min_grid, "--p-min-grid")
    specs = [spec for spec in parse_method_specs(args.spec_type) if spec[1]]
    if any(options for _, _, options in specs):
        raise ValueError("speculant tune: per-method options ([...]) are not supported; give "
                         "speculator options with --spec-option")
    methods = [(name, types) for name, types, _ in specs]
    if not methods:
        raise ValueError("--spec-type: give the speculators to tune, e.g. 'ngram_mod,suffix;draft'")
    if args.concurrency < 1 or args.max_tokens < 1:
        raise ValueError("--concurrency and --max-tokens must be >= 1")
    args.spec_type = ",".join(dict.fromkeys(t for _, types in methods for t in types))
    llm = LLM(args.model, **engine_options(args, max_num_seqs=args.concurrency))
    cats = args.categories.split(",") if args.categories else None
    prompts = [first_turn_prompt(r, llm.tokenizer) for r in read_prompts(args.prompts, cats, args.limit)]
    rows, best = _search(llm.engine, prompts, methods, grid, p_grid, args.max_tokens)
    print(_table(rows))
    write_spec_params(args.out, best, machine_info(llm.engine.config.num_threads or 0), args.concurrency)
    print(f"Wrote {args.out}: " + "; ".join(f"{m}: n_max {s.spec_n_max}, p_min {s.spec_p_min} "
                                             f"({s.speedup:.2f}x)" for m, s in best.items()))
    return 0


def _search(engine, prompts, methods, grid, p_grid, max_tokens):
    """Every setting of every method, plain interleaved; returns table rows and the best."""
    from tqdm import tqdm

    settings = [(name, types, n, p) for name, types in methods for n in grid for p in p_grid]
    rows, best = [], {}
    plain = _decode_rate(engine, prompts, None, 0, 0.0, max_tokens)
    for name, types, n, p in tqdm(settings, desc="tune", unit="setting", file=sys.stderr):
        rate = _decode_rate(engine, prompts, types, n, p, max_tokens)
        plain = 0.5 * (plain + _decode_rate(engine, prompts, None, 0, 0.0, max_tokens))
        rows.append((name, n, p, rate, rate / plain if plain else 0.0))
        current = best.get(name)
        if current is None or rate > current.decode_tok_s:
            best[name] = SpecSetting(n, p, round(rate, 2), round(rate / plain, 3) if plain else 1.0)
    for name, setting in best.items():
        if setting.speedup < 1.0:  # nothing beat plain decoding: switch speculation off
            best[name] = SpecSetting(0, 0.0, round(plain, 2), 1.0)
    return rows, best


def _decode_rate(engine, prompts, types, n_max, p_min, max_tokens) -> float:
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    spec = SpecParams(enabled=False) if types is None else SpecParams(types=types, n_max=n_max,
                                                                      p_min=p_min)
    engine.reset_stats()
    t0 = time.perf_counter()
    engine.run_to_completion(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                     ignore_eos=True, spec=spec))
    st = engine.stats
    return st.decode_tokens / st.decode_time_s if st.decode_time_s else \
        st.num_generated_tokens / (time.perf_counter() - t0)


def _table(rows) -> str:
    lines = ["| method | n_max | p_min | decode tok/s | vs plain |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {n} | {p} | {r:.1f} | {s:.2f}x |" for m, n, p, r, s in rows]
    return "\n".join(lines)


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected positive integers like 1,2,4,8, got {text!r}")
    return values


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise ValueError(f"{flag}: expected numbers in [0, 1] like 0,0.2, got {text!r}")
    return values
