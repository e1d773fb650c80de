"""`speculant bench`: plain and speculative decoding on the same prompts, in one process.

    speculant bench [--prompts FILE.jsonl [--categories a,b] [--limit N]]
                    [--spec-type "a,b;c"] [--concurrency 1,8] [--max-tokens N] [--repeats R]
                    [--min-seconds S] [--max-repeats N]
                    [--no-interleave | --interleave-seconds S]
                    [--compare hf[,openai=URL]] [--record FILE] [--out-dir DIR]
    speculant bench --replay RECORDS.jsonl --spec-type "a,b;c"      (no model: bench/replay.py)

Every method (plain, then each ';'-separated chain of --spec-type) runs every category at every
concurrency on one loaded model. By default (--interleave) each method has its own engine on
that model and the methods run side by side, in turns of --interleave-seconds (bench/interleave.py),
so that drift on a shared machine hits all of them alike; with --no-interleave one engine runs
them one after the other (plain, A, B, then B, A, plain on the next repeat). Speculator state is
rebuilt before every run, so nothing learned on a previous run (global suffix trees, n-gram
pools) inflates the next one. Every run is watched for CPU interference (bench/timing.py) and
can be re-run. Output: a markdown table and a summary on stdout, a chart and a JSON file in --out-dir
(named by date), and as the last stdout line the same JSON object (schema: bench/report.py).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import dataclass

from speculant.bench.confidence import (paired_repeats_interval, prompt_decode,
                                        prompt_decode_repeats, ratio_interval)
from speculant.bench.options import (PeerSpec, check_args, is_tuned, merge_spec_options,
                                     parse_compare, parse_levels, parse_method_specs,
                                     wants_another_repeat)
from speculant.bench.report import PLAIN, RunResult, emit_report, now_iso, paired_speedup
from speculant.engine.request_output import decode_rate
from speculant.speculators.counters import total

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


# Below this share of its tokens committed in decode-only steps, a cell's progress line also
# gives the per-request speedup: the decode rate then stands for the batch's tail. Measured on 13
# code_edit prompts (~3,000 tokens) at c=8 (AMD EPYC Zen 4, the 4-layer draft): prompt chunks
# ran beside decoding in most steps, plain's decode-only steps held 1,773 of 3,328 tokens, mostly
# 8 sequences at a time, the draft's 413-680, mostly the last 1-4 sequences: two repeats of the
# same run read 1.16x and 1.46x plain.
PARTIAL_COVERAGE = 0.5


@dataclass(slots=True)
class BenchPrompt:
    id: str
    category: str
    text: str


@dataclass(slots=True)
class Run:
    """One timed pass of one method over a category's prompts."""

    wall_s: float
    stats: object  # EngineStats
    seqs: list  # [Sequence], in prompt order
    usage: object  # bench.timing.CpuUsage
    num_reruns: int
    row_cost: float | None = None  # engine's fitted cost of a verified row (speculative runs)
    tuner: dict | None = None  # the tuner's state at the end of the run (--spec-tune)
    rests: dict | None = None  # model drafters' rests at the end of the run (drafter_ledger.py)

    @property
    def decode_rate(self) -> float:
        st = self.stats
        return st.decode_tokens / st.decode_time_s if st.decode_time_s else 0.0

    @property
    def request_decode_rate(self) -> float:
        """The requests' own decode speed, averaged: each request's tokens after its first over
        the time of the steps that decoded it (`Sequence.decode_step_time_s`), those that also
        ran other requests' prompt chunks included."""
        return request_decode_rate(self.seqs)

    @property
    def decode_coverage(self) -> float:
        """The share of the generated tokens that `decode_rate` was measured on (those
        committed in steps without a prompt chunk)."""
        generated = sum(s.num_generated for s in self.seqs)
        return self.stats.decode_tokens / generated if generated else 0.0


# ---- the run -----------------------------------------------------------------------------------

def run_bench(args) -> int:
    check_args(args)
    if args.replay:
        from speculant.bench.replay import run_replay

        return run_replay(args)
    levels = parse_levels(args.concurrency)
    peer_specs = parse_compare(args.compare)
    specs = parse_method_specs(args.spec_type, args.tune_compare)
    methods = [(name, types) for name, types, _ in specs]
    engine = _engine(args, levels, methods)
    engines = _method_engines(engine, args, specs)
    groups = _prompt_groups(args, engine.tokenizer)
    threads = _threads()
    date, t0 = now_iso(), time.perf_counter()
    _warm_up(engines, args, methods, groups)
    results, plain_runs = _measure_all(engines, args, methods, groups, levels, threads)
    if args.record:
        _write_records(args.record, groups, plain_runs)
    peers = _compare(args, engine, groups, peer_specs, threads)
    meta = _meta(args, engine, date, levels, methods, threads)
    meta["method_options"] = {name: options for name, _, options in specs if options}
    meta["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return _report(args, meta, results, peers)


def _engine(args, levels: list[int], methods):
    from speculant.cli.options import engine_options
    from speculant.engine.engine import Engine
    from speculant.engine.config import EngineConfig

    options = engine_options(args, max_num_seqs=max(levels))
    options["spec_type"] = sorted({t for _, types in methods for t in types})
    return Engine(EngineConfig(model=args.model, **options))


def _method_engines(engine, args, specs) -> dict:
    """The engine of each method: one each on the same loaded model with --interleave (plain
    keeps the first), the one engine for all of them otherwise; a method with options of its
    own (`name[...]`) always has its own, its speculators built with them."""
    engines = {}
    for i, (name, _, options) in enumerate(specs):
        if options:
            engines[name] = engine.sibling(
                spec_options=merge_spec_options(engine.config.spec_options, options))
        else:
            engines[name] = engine if i == 0 or not args.interleave else engine.sibling()
    return engines


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _prompt_groups(args, tokenizer) -> dict[str, list[BenchPrompt]]:
    if args.prompts is None:
        return {"builtin": [BenchPrompt(f"builtin-{i}", "builtin",
                                        tokenizer.apply_chat_template([{"role": "user", "content": p}]))
                            for i, p in enumerate(BUILTIN_PROMPTS[:args.limit])]}
    from speculant.data.prompt_set import first_turn_prompt, read_prompts

    cats = args.categories.split(",") if args.categories else None
    groups: dict[str, list[BenchPrompt]] = {}
    for rec in read_prompts(args.prompts, cats, args.limit):
        groups.setdefault(rec.category, []).append(
            BenchPrompt(rec.id, rec.category, first_turn_prompt(rec, tokenizer)))
    if not groups:
        raise ValueError(f"{args.prompts}: no prompts to benchmark")
    return groups


def _params(args, types: list[str], max_tokens: int | None = None):
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    spec = SpecParams(enabled=bool(types), types=types or None, verify=args.verify)
    if types and getattr(args, "spec_params", None):  # this chain's limits from `speculant tune`
        from speculant.engine.spec_params import read_spec_params, setting_for

        setting = setting_for(read_spec_params(args.spec_params), types)
        if setting is not None:
            spec.n_max, spec.p_min = setting.spec_n_max, setting.spec_p_min
    return SamplingParams(max_tokens=max_tokens or args.max_tokens, temperature=args.temperature,
                          top_k=getattr(args, "top_k", 0), top_p=getattr(args, "top_p", 1.0),
                          min_p=getattr(args, "min_p", 0.0), seed=0, ignore_eos=args.ignore_eos,
                          spec=spec)


def _warm_up(engines: dict, args, methods, groups) -> None:
    """One short untimed run per method on the shortest prompt: first-call costs go here."""
    if args.warmup_tokens == 0:
        return
    shortest = min((p.text for ps in groups.values() for p in ps), key=len)
    for name, types in _progress(methods, "warm-up", "method"):
        engine = engines[name]
        engine.set_limits(max_num_seqs=1)
        engine.set_tuning(_tuned(args, name, types))
        engine.run_to_completion([shortest], _params(args, types, args.warmup_tokens))
    for engine in {id(e): e for e in engines.values()}.values():
        engine.reset_stats()


def _measure_all(engines: dict, args, methods, groups, levels, threads):
    """Every category x concurrency x repeat x method; returns the results and plain's runs at
    the first level (for --record). A cell runs --repeats times, then again while plain's
    decoding in it has been timed for less than --min-seconds (up to --max-repeats)."""
    results, plain_runs = [], {}
    bar = _progress(None, "bench", "run",
                    total=len(groups) * len(levels) * args.repeats * len(methods))
    for category, prompts in groups.items():
        for level in levels:
            runs = {name: [] for name, _ in methods}
            while wants_another_repeat([r.stats.decode_time_s for r in runs[PLAIN]],
                                       args.repeats, args.min_seconds, args.max_repeats):
                repeat = len(runs[PLAIN])
                if repeat >= args.repeats:  # a repeat that --min-seconds adds
                    bar.total += len(methods)
                if args.interleave:
                    bar.set_postfix_str(f"{category} c={level} all methods")
                    for name, run in _interleaved_run(engines, args, methods, prompts, level,
                                                      threads, f"{category} c={level}").items():
                        runs[name].append(run)
                    bar.update(len(methods))
                    continue
                # odd repeats run the methods in reverse: a machine that drifts (turbo, other
                # tenants) does not always favour the first method
                for name, types in (methods if repeat % 2 == 0 else methods[::-1]):
                    bar.set_postfix_str(f"{category} c={level} {name}")
                    engine = engines[name]
                    engine.set_tuning(_tuned(args, name, types))
                    runs[name].append(_timed_run(engine, args, types, prompts, level, threads,
                                                 f"{category} c={level} {name}"))
                    bar.update()
            plain = runs[PLAIN]
            if level == levels[0]:
                plain_runs[category] = plain[0]
            for name, _ in methods:
                res = _result(name, category, level, runs[name], None if name == PLAIN else plain)
                results.append(res)
                bar.write(_progress_line(res, runs[PLAIN]), file=sys.stderr)
    bar.close()
    return results, plain_runs


def _tuned(args, name: str, types: list[str]) -> bool:
    """Whether this method runs with the online tuner: all speculative methods with
    --spec-tune, the METHOD+tuned twins with --tune-compare."""
    return bool(types) and (args.spec_tune or is_tuned(name))


def _timed_run(engine, args, types, prompts, level, threads, label) -> Run:
    from speculant.bench.timing import run_with_reruns

    params = _params(args, types)
    texts = [p.text for p in prompts]

    def once():
        engine.set_limits(max_num_seqs=level)
        engine.reset_stats()
        t0 = time.perf_counter()
        seqs = engine.run_to_completion(texts, params)
        return (time.perf_counter() - t0, engine.stats, seqs, engine.cost.cost_per_token(level),
                engine.status())

    (wall, stats, seqs, row_cost, status), usage, reruns = run_with_reruns(
        once, threads, args.rerun_on_interference, label, args.interference_tolerance,
        warn=_progress_write)
    return Run(wall, stats, seqs, usage, reruns, row_cost if types else None,
               status.tuner if types else None, status.rests if types else None)


def _interleaved_run(engines: dict, args, methods, prompts, level, threads, label) -> dict[str, Run]:
    """All methods side by side on their own engines (bench/interleave.py); the interference
    verdict covers them together, and a re-run re-runs them all."""
    from speculant.bench.interleave import run_interleaved
    from speculant.bench.timing import run_with_reruns

    texts = [p.text for p in prompts]
    order = [engines[name] for name, _ in methods]

    def once():
        for (name, types), engine in zip(methods, order):
            engine.set_tuning(_tuned(args, name, types))
            engine.set_limits(max_num_seqs=level)
            engine.reset_stats()
        done = run_interleaved(order, texts, [_params(args, types) for _, types in methods],
                               args.interleave_seconds)
        return [(d.wall_s, e.stats, d.seqs, e.cost.cost_per_token(level), e.status())
                for d, e in zip(done, order)]

    measured, usage, reruns = run_with_reruns(
        once, threads, args.rerun_on_interference, label, args.interference_tolerance,
        warn=_progress_write)
    return {name: Run(wall, stats, seqs, usage, reruns, row_cost if types else None,
                      status.tuner if types else None, status.rests if types else None)
            for (name, types), (wall, stats, seqs, row_cost, status) in zip(methods, measured)}


def request_decode_rate(seqs) -> float:
    """Mean over `seqs` of each one's (tokens after the first) / (time of the steps that decoded
    it); sequences with fewer than two tokens or no decoding step are left out (0.0 when none is
    left). Engine time, not a wall clock from first token to finish: with --interleave each
    engine waits through the others' turns while they all run, and a method that finishes early
    leaves the rest to run alone (measured by wall clock on 13 code_edit prompts at c=8, the
    chain read 0.62x plain per request where its decode rate read 1.47x)."""
    rates = [decode_rate(s.num_generated, s.decode_step_time_s) for s in seqs]
    rates = [r for r in rates if r > 0]
    return statistics.fmean(rates) if rates else 0.0


def _result(name: str, category: str, level: int, runs: list[Run],
            plain: list[Run] | None) -> RunResult:
    rates = [r.decode_rate for r in runs]
    chosen = runs[rates.index(statistics.median_low(rates))]
    st, seqs = chosen.stats, chosen.seqs
    spec = total(s.spec for s in seqs)
    gen = sum(s.num_generated for s in seqs)
    step_time = st.time_draft_s + st.time_forward_s + st.time_verify_s
    return RunResult(
        method=name, concurrency=level, category=category, num_prompts=len(seqs),
        prompt_tokens=sum(s.num_prompt for s in seqs), generated_tokens=gen,
        prefill_tok_s=round(st.num_prompt_tokens / st.prefill_time_s, 1) if st.prefill_time_s else 0.0,
        decode_tok_s=round(statistics.median(rates), 2), e2e_tok_s=round(gen / chosen.wall_s, 2),
        mean_accepted_length=round(spec.mean_accepted_length, 3),
        acceptance_rate=round(spec.acceptance_rate, 3),
        mean_accepted_length_per_draft=round(spec.mean_accepted_length_per_draft, 3),
        draft_time_share=round(st.time_draft_s / step_time, 3) if step_time else 0.0,
        identical_to_plain=_num_identical(runs, plain[0]) if plain else None,
        repeats_decode_tok_s=[round(r, 2) for r in rates], decode_tok_s_best=round(max(rates), 2),
        decode_coverage=round(chosen.decode_coverage, 3),
        request_decode_tok_s=round(statistics.median(r.request_decode_rate for r in runs), 2),
        repeats_request_decode_tok_s=[round(r.request_decode_rate, 2) for r in runs],
        num_steps=spec.num_steps, num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens,
        interference=any(r.usage.interference for r in runs),
        other_cpu_cores=round(max(r.usage.other_cpu_cores for r in runs), 3),
        own_cpu_util=round(statistics.median(r.usage.own_cpu_util for r in runs), 3),
        num_reruns=sum(r.num_reruns for r in runs),
        row_cost=None if chosen.row_cost is None else round(chosen.row_cost, 4),
        tuner=chosen.tuner,
        rests=chosen.rests,
        token_ids=[[s.output_ids for s in r.seqs] for r in runs],
        prompt_decode=prompt_decode([r.seqs for r in runs]),
        prompt_decode_repeats=prompt_decode_repeats([r.seqs for r in runs]),
        mean_accepted_length_ci=_accepted_length_interval(seqs),
    )


def _accepted_length_interval(seqs) -> list[float] | None:
    """The 95% interval of 1 + accepted / steps over the run's prompts resampled (None without
    drafts)."""
    if not any(s.spec.num_drafts for s in seqs):
        return None
    interval = ratio_interval([(s.spec.num_accepted_tokens, s.spec.num_steps) for s in seqs])
    return None if interval is None else [round(1 + x, 3) for x in interval]


def _num_identical(runs: list[Run], plain: Run) -> int:
    """Prompts whose output equals plain's in every repeat."""
    return sum(all(r.seqs[i].output_ids == ref.output_ids for r in runs)
               for i, ref in enumerate(plain.seqs))


def _progress_line(r: RunResult, plain_runs: list[Run]) -> str:
    speedup = paired_speedup(r.repeats_decode_tok_s, [round(p.decode_rate, 2) for p in plain_runs])
    same = "" if r.identical_to_plain is None else f", same {r.identical_to_plain}/{r.num_prompts}"
    flag = ", INTERFERENCE" if r.interference else ""
    runs = len(r.repeats_decode_tok_s)
    repeats = f", median of {runs} repeats" if runs > 1 else ""
    partial = ""
    if r.decode_coverage < PARTIAL_COVERAGE:
        per_request = paired_speedup(r.repeats_request_decode_tok_s,
                                     [round(p.request_decode_rate, 2) for p in plain_runs])
        partial = (f", decode-only steps {r.decode_coverage:.0%} of the tokens, per request "
                   f"{per_request:.2f}x")
    interval = paired_repeats_interval(r.prompt_decode_repeats,
                                       prompt_decode_repeats([p.seqs for p in plain_runs])) \
        if r.prompt_decode_repeats and r.method != PLAIN else None
    ci = "" if interval is None else f" (95% CI {interval[0]:.2f}-{interval[1]:.2f})"
    acc = "" if not r.mean_accepted_length_ci else \
        f" [{r.mean_accepted_length_ci[0]:.2f}-{r.mean_accepted_length_ci[1]:.2f}]"
    return (f"{r.category} c={r.concurrency} {r.method}: {r.decode_tok_s:.1f} tok/s, "
            f"{speedup:.2f}x{ci}, acc.len {r.mean_accepted_length:.2f}{acc} "
            f"({r.mean_accepted_length_per_draft:.2f} per draft){same}{repeats}{partial}{flag}")


def _write_records(path: str, groups: dict[str, list[BenchPrompt]], plain_runs: dict[str, Run]) -> None:
    """The plain run's outputs, one replay record per prompt."""
    with open(path, "w") as f:
        for category, prompts in groups.items():
            for prompt, seq in zip(prompts, plain_runs[category].seqs):
                f.write(json.dumps({"id": prompt.id, "category": category,
                                    "prompt_ids": list(seq.prompt_ids),
                                    "output_ids": list(seq.output_ids)}) + "\n")


# ---- peers and report --------------------------------------------------------------------------

def _compare(args, engine, groups, specs: list[PeerSpec], threads: int) -> list:
    texts = {cat: [p.text for p in ps] for cat, ps in groups.items()}
    peers = []
    for spec in specs:
        if spec.kind == "hf":
            from speculant.bench.hf_peer import run_hf_peer

            peers += run_hf_peer(engine.model_path, texts, args.max_tokens, args.peer_repeats,
                                 prompt_lookup=args.hf_prompt_lookup, draft_model=args.draft_model,
                                 threads=threads, max_reruns=args.rerun_on_interference,
                                 tolerance=args.interference_tolerance)
        else:
            from speculant.bench.openai_peer import run_openai_peer

            peers += run_openai_peer(spec.url, texts, args.max_tokens, args.peer_repeats,
                                     timeout_s=args.openai_timeout, ignore_eos=args.ignore_eos,
                                     levels=tuple(parse_levels(args.concurrency)))
    return peers


def _meta(args, engine, date: str, levels, methods, threads: int) -> dict:
    from speculant.bench.timing import machine_info

    return {"date": date, "machine": machine_info(threads), "model": engine.model_path,
            "dtype": engine.config.dtype, "kv_dtype": engine.config.kv_dtype,
            "max_tokens": args.max_tokens, "concurrency": levels, "repeats": args.repeats,
            "min_seconds": args.min_seconds, "max_repeats": args.max_repeats,
            "sampling": {"temperature": args.temperature, "top_k": args.top_k,
                         "top_p": args.top_p, "min_p": args.min_p, "verify": args.verify},
            "interleave_s": args.interleave_seconds if args.interleave else None,
            "peer_repeats": args.peer_repeats if args.compare else 0,
            "methods": [name for name, _ in methods]}


def _report(args, meta: dict, results: list[RunResult], peers: list) -> int:
    from speculant.bench.report import build_report, markdown_table, peers_table, summary_text

    report = build_report(meta, results, peers)
    emit_report(report, args, [markdown_table(report), peers_table(report), summary_text(report)])
    return 0


def _progress(items, desc: str, unit: str, total: int | None = None):
    """A progress bar on stderr (tqdm)."""
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5)


def _progress_write(msg: str) -> None:
    from tqdm import tqdm

    tqdm.write(msg, file=sys.stderr)
