"""`speculant bench`: prefill and decode tokens/s, plain and speculative, in one process.

Every method runs the same prompts in the same engine (one model load); speculator state is
rebuilt before every run so nothing learned on a previous run (global suffix trees, n-gram
pools) inflates the next one. Each measurement is repeated; the table shows medians. The last
stdout line is one JSON object (schema in the README).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

BUILTIN_PROMPTS = [
    "Explain how a hash map works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Summarize the causes of the French Revolution in five bullet points.",
    "What are the differences between TCP and UDP? Answer in a table.",
    "Give me a recipe for a vegetarian lasagna.",
    "Translate to French: 'The weather is nice today, let us go for a walk in the park.'",
    "Write a Python function that checks whether a string is a palindrome, and test it.",
    "Why is the sky blue? Explain it to a ten year old.",
]


def add_bench_args(p) -> None:
    g = p.add_argument_group("bench")
    g.add_argument("--prompts", default=None, help="JSONL prompt file (default: 8 built-in prompts)")
    g.add_argument("--categories", default=None, help="comma-separated categories of --prompts")
    g.add_argument("--limit", type=int, default=None, help="prompts per category")
    g.add_argument("--concurrency", default="1,8", help="comma-separated concurrency levels")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--repeats", type=int, default=1, help="repeats per measurement (median shown)")
    g.add_argument("--verify", default="auto", choices=["auto", "greedy", "match", "rejection"])
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-tokens (fixed-length decode measurement)")
    g.add_argument("--compare", default=None, help="peer to measure in the same run: hf")
    g.add_argument("--json-out", default=None, help="also write the JSON result to this file")


@dataclass(slots=True)
class RunResult:
    method: str
    concurrency: int
    category: str
    num_prompts: int
    prompt_tokens: int
    generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    e2e_tok_s: float
    mean_accepted_length: float
    acceptance_rate: float
    draft_time_share: float
    identical_to_plain: int | None = None
    repeats_decode_tok_s: list[float] = field(default_factory=list)
    token_ids: list = field(default_factory=list)


def parse_methods(spec_type: str) -> list[tuple[str, list[str]]]:
    """'ngram_mod,suffix;draft' -> [('plain', []), ('ngram_mod,suffix', [...]), ('draft', [...])]."""
    from speculant.engine_config import parse_spec_types

    methods = [("plain", [])]
    for chain in (spec_type or "none").split(";"):
        types = parse_spec_types(chain)
        if types:
            methods.append((",".join(types), types))
    return methods


def _prompt_groups(args, tokenizer) -> dict[str, list[str]]:
    if args.prompts is None:
        return {"builtin": [tokenizer.apply_chat_template([{"role": "user", "content": p}])
                            for p in BUILTIN_PROMPTS]}
    from speculant.prompt_set import first_turn_prompt, read_prompts

    cats = args.categories.split(",") if args.categories else None
    groups: dict[str, list[str]] = {}
    for rec in read_prompts(args.prompts, cats, args.limit):
        groups.setdefault(rec.category, []).append(first_turn_prompt(rec, tokenizer))
    return groups


def run_bench(args) -> int:
    from speculant.cli import engine_options
    from speculant.engine import Engine
    from speculant.engine_config import EngineConfig

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs positive integers, got {args.concurrency!r}")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    methods = parse_methods(args.spec_type)
    options = engine_options(args, max_num_seqs=max(levels))
    options["spec_type"] = sorted({t for _, types in methods for t in types})
    engine = Engine(EngineConfig(model=args.model, **options))
    groups = _prompt_groups(args, engine.tokenizer)
    _warm_up(engine, next(iter(groups.values()))[0])
    results: list[RunResult] = []
    for category, prompts in groups.items():
        for c in levels:
            plain = None
            for name, types in methods:
                res = _measure(engine, args, name, types, prompts, c, category)
                if plain is None:
                    plain = res
                else:
                    res.identical_to_plain = sum(a == b for a, b in zip(res.token_ids, plain.token_ids))
                results.append(res)
                print(_row(res, plain), file=sys.stderr, flush=True)
    peers = _compare(args, engine, groups) if args.compare else {}
    print(_table(results, peers))
    summary = {"model": engine.model_path, "max_tokens": args.max_tokens,
               "results": [{k: v for k, v in asdict(r).items() if k != "token_ids"} for r in results],
               "peers": peers}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


def _warm_up(engine, prompt: str) -> None:
    from speculant.sampling_params import SamplingParams, SpecParams

    _generate(engine, [prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                               spec=SpecParams(enabled=False)))
    engine.reset_stats()


def _generate(engine, prompts, params) -> list:
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for s in seqs:
        engine.release(s)
    return seqs


def _measure(engine, args, name, types, prompts, concurrency, category) -> RunResult:
    from speculant.sampling_params import SamplingParams, SpecParams

    spec = SpecParams(enabled=bool(types), types=types or None, verify=args.verify)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0,
                            ignore_eos=args.ignore_eos, spec=spec)
    engine.scheduler.max_num_seqs = concurrency
    runs = []
    for _ in range(args.repeats):
        engine.reset_stats()
        t0 = time.perf_counter()
        seqs = _generate(engine, prompts, params)
        wall = time.perf_counter() - t0
        runs.append((wall, seqs, engine.stats, engine.chain.stats))
    decode_rates = [st.decode_tokens / st.decode_time_s if st.decode_time_s else 0.0
                    for _, _, st, _ in runs]
    median = statistics.median(decode_rates)
    wall, seqs, st, spec_stats = runs[decode_rates.index(median)] if median in decode_rates else runs[0]
    drafts = sum(s.spec.num_drafts for s in seqs)
    draft_tok = sum(s.spec.num_draft_tokens for s in seqs)
    acc_tok = sum(s.spec.num_accepted_tokens for s in seqs)
    steps = sum(s.spec.num_steps for s in seqs)
    gen = sum(s.num_generated for s in seqs)
    step_time = st.time_draft_s + st.time_forward_s + st.time_verify_s
    return RunResult(
        method=name, concurrency=concurrency, category=category, num_prompts=len(prompts),
        prompt_tokens=sum(s.num_prompt for s in seqs), generated_tokens=gen,
        prefill_tok_s=round(st.num_prompt_tokens / st.prefill_time_s, 1) if st.prefill_time_s else 0.0,
        decode_tok_s=round(median, 2), e2e_tok_s=round(gen / wall, 2),
        mean_accepted_length=round(1 + acc_tok / steps, 3) if steps and drafts else 1.0,
        acceptance_rate=round(acc_tok / draft_tok, 3) if draft_tok else 0.0,
        draft_time_share=round(st.time_draft_s / step_time, 3) if step_time else 0.0,
        repeats_decode_tok_s=[round(r, 2) for r in decode_rates],
        token_ids=[s.output_ids for s in seqs],
    )


def _row(r: RunResult, plain: RunResult | None) -> str:
    speedup = r.decode_tok_s / plain.decode_tok_s if plain and plain.decode_tok_s else 1.0
    same = "" if r.identical_to_plain is None else f"{r.identical_to_plain}/{r.num_prompts}"
    return (f"| {r.category:<14} | {r.method:<28} | {r.concurrency:>4} | {r.prefill_tok_s:>9.1f} | "
            f"{r.decode_tok_s:>9.2f} | {speedup:>6.2f}x | {r.mean_accepted_length:>6.2f} | "
            f"{r.acceptance_rate:>5.2f} | {r.draft_time_share:>5.2f} | {same:>7} |")


def _table(results: list[RunResult], peers: dict) -> str:
    head = ("| category       | method                       | conc | prefill/s | decode/s  | speedup | "
            "acc.len | acc.% | draft | same    |\n"
            "|----------------|------------------------------|------|-----------|-----------|---------|"
            "--------|-------|-------|---------|")
    rows = []
    plain = {}
    for r in results:
        if r.method == "plain":
            plain[(r.category, r.concurrency)] = r
        rows.append(_row(r, plain.get((r.category, r.concurrency))))
    for name, peer in peers.items():
        rows.append(f"| {peer.get('category', ''):<14} | {name:<28} | {1:>4} | "
                    f"{peer.get('prefill_tok_s', 0.0):>9.1f} | {peer['decode_tok_s']:>9.2f} | "
                    f"{'':>7} | {'':>6} | {'':>5} | {'':>5} | {'':>7} |")
    return head + "\n" + "\n".join(rows)


def _compare(args, engine, groups) -> dict:
    if args.compare != "hf":
        raise ValueError(f"--compare: unknown peer {args.compare!r} (known: hf)")
    from speculant.hf_peer import hf_decode_rate

    prompts = [p for ps in groups.values() for p in ps]
    return {"hf_transformers_fp32": hf_decode_rate(engine.model_path, prompts, args.max_tokens,
                                                   args.repeats)}
