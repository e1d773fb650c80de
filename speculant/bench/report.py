"""`speculant bench` results: the JSON document, the markdown table, the summary and the chart.

JSON schema (`"schema": "speculant-bench/2"`; the file in `--out-dir` and the last stdout line
are the same object). Rates are decode tokens/s: tokens after the first of each request over the
time of steps without a prompt chunk (prefill excluded), summed over a category's prompts.

Top level
  schema         "speculant-bench/2"
  date           ISO 8601 local time of the run, e.g. "2025-05-01T10:20:30+00:00"
  elapsed_s      seconds from the first warm-up to the end of the peers (model load excluded)
  machine        {"cpu", "num_cpus", "threads", "platform", "python", "torch"}
  model          the target model's path
  dtype          weights (--dtype: auto = as stored in the GGUF)
  kv_dtype       KV cache element type (float16 or float32, --kv-dtype resolved)
  max_tokens     tokens generated per prompt (EOS stops earlier unless --ignore-eos)
  concurrency    [int], the levels measured
  sampling       {"temperature", "top_k", "top_p", "min_p", "verify"}: every request's settings
                 (seed 0 for all; temperature 0 = greedy)
  repeats        least measurements per (category, method, concurrency) (--repeats)
  min_seconds    a cell was repeated until plain decoding had been timed for this long in it
                 (--min-seconds; 0: exactly `repeats`); each result's repeats_decode_tok_s
                 lists the repeats it ran
  max_repeats    the most repeats --min-seconds adds up to
  interleave_s   the methods ran side by side in turns of this many seconds (--interleave),
                 or null: one after the other, in reverse order on odd repeats
  peer_repeats   measurements per peer prompt (--peer-repeats, default --repeats)
  methods        ["plain", then each --spec-type chain, e.g. "ngram_mod,suffix", or a chain with
                 options of its own, e.g. "eagle3[weights=q8_0]"]
  method_options {method: {speculator: {option: value}}}: the options of the methods named with
                 [...] (each ran on an engine of its own, built with them on top of
                 --spec-option); {} when none has any
  results        [Result], one per category x method x concurrency (flat list)
  categories     {category: Category}                                    per category
  by_method      {method: {concurrency as str: MethodSummary}}           per method
  peers          {peer name: Peer}  (empty without --compare)
  summary        {category: {concurrency as str: Best}}
  interference   true if any kept measurement saw other processes use the CPU
  files          {"json": path, "chart": path or null}

Result: one method on one category at one concurrency
  method, category, concurrency, num_prompts, prompt_tokens, generated_tokens
  prefill_tok_s         prompt tokens / time of steps with a prompt chunk
  decode_tok_s          median over repeats            decode_tok_s_best  fastest repeat
  repeats_decode_tok_s  [float], every repeat          e2e_tok_s          generated / wall time
  speedup               over plain at the same category and concurrency: the median of the
                        per-repeat ratios (repeat k of a method over repeat k of plain: the
                        methods of one repeat ran side by side, so drift of a shared machine
                        cancels in each ratio); decode_tok_s / plain's when repeats differ
  repeats_speedup       [float], those per-repeat ratios (their spread is the noise of the run)
  vs_untuned            METHOD+tuned only (--tune-compare): its paired speedup over METHOD run
                        without the tuner (null otherwise)
  decode_coverage       the share of generated_tokens committed in steps without a prompt chunk,
                        i.e. what decode_tok_s was measured on (kept repeat). Long prompts at
                        c > 1 run their chunks beside the others' decoding; a method that
                        decodes faster then has fewer decode-only steps, mostly the batch's
                        tail (13 code_edit prompts at c=8: plain 0.53, the 4-layer draft
                        0.12-0.20), and its decode_tok_s stands for that tail
  request_decode_tok_s  the requests' own decode speed, averaged (each: tokens after its first /
                        the time of the engine steps that decoded it, steps that also ran
                        others' prompt chunks included), median over repeats;
                        repeats_request_decode_tok_s every repeat
  request_speedup       the paired speedup of request_decode_tok_s over plain's (null without
                        plain): the figure to read where decode_coverage is low
  request_vs_untuned    METHOD+tuned only: the same over METHOD run without the tuner
  speedup_ci            [low, high]: the 95% interval of the speedup over plain from a paired
                        bootstrap over the prompts (each prompt's share of the decode-only
                        steps: its tokens in them and an equal share of their time, summed over
                        repeats, so the cell's whole is its decode rate; bench/confidence.py):
                        how far the prompts' spread and the machine's drift leave the ratio
                        uncertain. null for plain and where the prompts do not pair up
  vs_untuned_ci         METHOD+tuned only: the same interval over METHOD run without the tuner
  mean_accepted_length_ci   [low, high]: the 95% interval of mean_accepted_length over the kept
                        repeat's prompts resampled (null without drafts)
  prompt_decode         per prompt, in prompt order: [decode tokens, decode seconds], its share
                        of the decode-only steps summed over repeats (two methods' lists pair
                        up prompt by prompt, e.g. for `confidence.paired_ratio_interval`
                        between any two of them: the ratio pooled over the repeats)
  prompt_decode_repeats the same per repeat, unsummed: what speedup_ci and vs_untuned_ci
                        resample (`confidence.paired_repeats_interval`: the median over
                        repeats of the paired ratios, the statistic speedup and vs_untuned are)
  mean_accepted_length  1 + accepted / verification steps (1.0 for plain)
  mean_accepted_length_per_draft   1 + accepted / drafts: over the steps that verified a draft
                        only (vLLM's "mean acceptance length"; 1.0 without drafts)
  acceptance_rate       accepted / drafted tokens (0.0 without drafts)
  draft_time_share      engine time_draft_s / step time (draft + forward + verify); time_draft_s
                        spans scheduling and drafting, so plain shows a small non-zero share
  identical_to_plain    prompts whose output equals plain greedy output in every repeat
                        (null for plain itself)
  num_steps, num_drafts, num_draft_tokens, num_accepted_tokens   raw counters
  interference          a kept repeat saw other processes use the CPU (see bench/timing.py)
  other_cpu_cores       the largest average of cores others used during a kept repeat
  own_cpu_util          our CPU time / (wall x threads), median over repeats
  num_reruns            repeats re-run because of interference (--rerun-on-interference)
  row_cost              what verifying one more draft token cost, as a fraction of a plain step
                        at this concurrency, from the engine's step-cost fit over the kept
                        repeat (null for plain: its steps all have one size, nothing to fit);
                        `--replay --replay-row-cost` takes the same quantity
  tuner                 with --spec-tune (null otherwise, and for plain): per concurrency bucket
                        the draft limit the tuner settled on (`n_max`, 0 = plain decoding), its
                        decode steps, how often it switched speculation off, goodput per limit
                        and its speedup over plain decoding measured at the same moments,
                        `steps_left_to_chain`: decode steps it left to the chain (every
                        speculator model-free, 4+ sequences: their own ledger account decides),
                        and `plain_probes_skipped`: probes of plain decoding skipped while the
                        step-cost model put drafting 1.5x or more ahead (`sure_lead`)
  rests                 per model drafter (eagle3, mtp, draft) and concurrency bucket: how often
                        the chain rested it where its measured gain fell under its cost
                        (`num_rests`, `num_rounds_rested`, `resting` at the end of the run;
                        speculators/drafter_ledger.py); `model-free`: the model-free speculators
                        together (buckets 4 and up); null for plain

Category
  num_prompts
  methods   {method: {concurrency as str: Result minus method, category, concurrency}}
  peers     {peer name: {"decode_tok_s", "ratio_plain", "ratio_best", "best_method"}}:
            speculant plain, and the category's best method, over the peer, both at the lowest
            concurrency measured (peers decode one request at a time)

MethodSummary: one method over all categories at one concurrency
  geomean_speedup, min_speedup, max_speedup, mean_accepted_length (over all steps),
  mean_accepted_length_per_draft (over the steps that verified a draft),
  acceptance_rate (over all drafts), identical_to_plain, num_prompts

Peer (--compare): the same prompts through another implementation, one request at a time
  kind           "hf" | "openai"
  method         "plain" | "prompt_lookup" | "assistant" | "server"
  decode_tok_s, decode_tok_s_best, prefill_tok_s, num_prompts, interference (null: not
  measurable, e.g. a server's CPU), plus kind-specific fields (dtype, url, timings_source, ...)
  per_category   {category: {"decode_tok_s", "decode_tok_s_best", "num_prompts",
                             "generated_tokens"}}

Best: the fastest speculative method of a category at one concurrency
  method, speedup, decode_tok_s, mean_accepted_length, identical_to_plain, num_prompts
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from datetime import datetime

from speculant.bench.confidence import paired_ratio_interval, paired_repeats_interval

SCHEMA = "speculant-bench/2"
PLAIN = "plain"
TUNED_SUFFIX = "+tuned"  # a method run with the online tuner (--tune-compare)


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
    mean_accepted_length_per_draft: float = 1.0
    identical_to_plain: int | None = None
    repeats_decode_tok_s: list[float] = field(default_factory=list)
    decode_tok_s_best: float = 0.0
    speedup: float = 1.0
    repeats_speedup: list[float] = field(default_factory=list)
    vs_untuned: float | None = None
    decode_coverage: float = 1.0
    request_decode_tok_s: float = 0.0
    repeats_request_decode_tok_s: list[float] = field(default_factory=list)
    request_speedup: float | None = None
    request_vs_untuned: float | None = None
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    interference: bool = False
    other_cpu_cores: float = 0.0
    own_cpu_util: float = 0.0
    num_reruns: int = 0
    row_cost: float | None = None
    tuner: dict | None = None
    rests: dict | None = None
    speedup_ci: list[float] | None = None
    vs_untuned_ci: list[float] | None = None
    mean_accepted_length_ci: list[float] | None = None
    # per prompt [decode tokens, decode seconds] of its share of the decode-only steps, summed
    # over repeats (confidence.py)
    prompt_decode: list = field(default_factory=list)
    # ... and per repeat, unsummed: what the intervals resample, as the speedups pair repeats
    prompt_decode_repeats: list = field(default_factory=list)
    token_ids: list = field(default_factory=list)  # per prompt, per repeat; not in the JSON

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "token_ids"}
        out["prompt_decode"] = [[n, round(t, 6)] for n, t in self.prompt_decode]
        out["prompt_decode_repeats"] = [[[n, round(t, 6)] for n, t in repeat]
                                        for repeat in self.prompt_decode_repeats]
        return out


@dataclass(slots=True)
class PeerResult:
    """A peer on one category: per repeat, decode tokens and the time they took."""

    name: str
    kind: str
    method: str
    category: str
    num_prompts: int
    generated_tokens: int
    decode_tokens: list[int]  # [repeats]
    decode_time_s: list[float]  # [repeats]
    prefill_tok_s: float = 0.0
    interference: bool | None = None
    num_reruns: int = 0
    detail: dict = field(default_factory=dict)

    @property
    def rates(self) -> list[float]:
        return [n / t for n, t in zip(self.decode_tokens, self.decode_time_s) if t > 0]

    @property
    def decode_tok_s(self) -> float:
        return round(statistics.median(self.rates), 2) if self.rates else 0.0

    @property
    def decode_tok_s_best(self) -> float:
        return round(max(self.rates), 2) if self.rates else 0.0


# ---- the JSON document -----------------------------------------------------------------------

def paired_ratios(rates: list[float], base_rates: list[float]) -> list[float]:
    """Repeat k of a method over repeat k of its baseline (they ran at the same moments); empty
    when the repeats do not pair up."""
    if len(rates) != len(base_rates) or not all(b > 0 for b in base_rates):
        return []
    return [a / b for a, b in zip(rates, base_rates)]


def paired_speedup(rates: list[float], base_rates: list[float]) -> float:
    """The median paired ratio; with unpaired repeats the ratio of the medians."""
    ratios = paired_ratios(rates, base_rates)
    if ratios:
        return statistics.median(ratios)
    base = statistics.median(base_rates) if base_rates else 0.0
    return statistics.median(rates) / base if rates and base else 0.0


def fill_speedups(results: list[RunResult]) -> None:
    """Speedup of each result over plain at the same category and concurrency."""
    plain = {(r.category, r.concurrency): r for r in results if r.method == PLAIN}
    for r in results:
        base = plain.get((r.category, r.concurrency))
        if base is None:
            r.speedup, r.repeats_speedup = 0.0, []
            continue
        r.speedup = round(paired_speedup(r.repeats_decode_tok_s, base.repeats_decode_tok_s), 3)
        r.repeats_speedup = [round(x, 3) for x in
                             paired_ratios(r.repeats_decode_tok_s, base.repeats_decode_tok_s)]
    by_key = {(r.category, r.concurrency, r.method): r for r in results}
    for r in results:
        twin = by_key.get((r.category, r.concurrency, r.method.removesuffix(TUNED_SUFFIX)))
        if r.method.endswith(TUNED_SUFFIX) and twin is not None:
            r.vs_untuned = round(paired_speedup(r.repeats_decode_tok_s, twin.repeats_decode_tok_s), 3)
            r.request_vs_untuned = _request_ratio(r, twin)
            r.vs_untuned_ci = _interval(r, twin)
        r.request_speedup = _request_ratio(r, plain.get((r.category, r.concurrency)))
        r.speedup_ci = _interval(r, plain.get((r.category, r.concurrency)))


def _interval(r: RunResult, base: RunResult | None) -> list[float] | None:
    """The 95% interval of r's decode rate over `base`'s, prompts resampled in pairs
    (confidence.py); None without both's per-prompt times, and for plain over itself."""
    if base is None or base is r or not r.prompt_decode or not base.prompt_decode:
        return None
    if r.prompt_decode_repeats and base.prompt_decode_repeats:
        interval = paired_repeats_interval(r.prompt_decode_repeats, base.prompt_decode_repeats)
    else:  # a result given only the summed lists
        interval = paired_ratio_interval(r.prompt_decode, base.prompt_decode)
    return None if interval is None else [round(x, 3) for x in interval]


def _request_ratio(r: RunResult, base: RunResult | None) -> float | None:
    """The paired speedup of r's per-request decode rates over `base`'s (None without both)."""
    if base is None or not base.repeats_request_decode_tok_s or \
            not r.repeats_request_decode_tok_s:
        return None
    return round(paired_speedup(r.repeats_request_decode_tok_s,
                                base.repeats_request_decode_tok_s), 3)


def build_report(meta: dict, results: list[RunResult], peers: list[PeerResult]) -> dict:
    """The whole JSON document; `meta` holds date, machine, model, max_tokens, concurrency,
    repeats, methods."""
    fill_speedups(results)
    categories = {r.category: None for r in results}
    summary = {cat: _best_by_level(results, cat) for cat in categories}
    return {
        "schema": SCHEMA, **meta,
        "results": [r.to_dict() for r in results],
        "categories": {cat: _category(results, peers, cat, summary[cat]) for cat in categories},
        "by_method": _by_method(results),
        "peers": _peers(peers),
        "summary": summary,
        "interference": any(r.interference for r in results) or any(p.interference for p in peers),
        "files": {"json": None, "chart": None},
    }


def _category(results: list[RunResult], peers: list[PeerResult], cat: str, best: dict) -> dict:
    mine = [r for r in results if r.category == cat]
    methods: dict[str, dict] = {}
    for r in mine:
        row = {k: v for k, v in r.to_dict().items() if k not in ("method", "category", "concurrency")}
        methods.setdefault(r.method, {})[str(r.concurrency)] = row
    return {"num_prompts": max((r.num_prompts for r in mine), default=0), "methods": methods,
            "peers": _peer_ratios(mine, [p for p in peers if p.category == cat], best)}


def _peer_ratios(mine: list[RunResult], peers: list[PeerResult], best: dict) -> dict:
    if not mine or not peers:
        return {}
    level = min(r.concurrency for r in mine)
    plain = next((r for r in mine if r.method == PLAIN and r.concurrency == level), None)
    top = best.get(str(level))
    top_rate = top["decode_tok_s"] if top else (plain.decode_tok_s if plain else 0.0)
    out = {}
    for p in peers:
        rate = p.decode_tok_s
        out[p.name] = {"decode_tok_s": rate,
                       "ratio_plain": _ratio(plain.decode_tok_s if plain else 0.0, rate),
                       "ratio_best": _ratio(top_rate, rate),
                       "best_method": top["method"] if top else PLAIN}
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


def _best_by_level(results: list[RunResult], cat: str) -> dict:
    out = {}
    for level in sorted({r.concurrency for r in results if r.category == cat}):
        spec = [r for r in results if r.category == cat and r.concurrency == level and r.method != PLAIN]
        if not spec:
            continue
        b = max(spec, key=lambda r: r.speedup)
        out[str(level)] = {"method": b.method, "speedup": b.speedup, "decode_tok_s": b.decode_tok_s,
                           "mean_accepted_length": b.mean_accepted_length,
                           "identical_to_plain": b.identical_to_plain, "num_prompts": b.num_prompts}
    return out


def _by_method(results: list[RunResult]) -> dict:
    out: dict[str, dict] = {}
    for method in dict.fromkeys(r.method for r in results):
        for level in sorted({r.concurrency for r in results if r.method == method}):
            rows = [r for r in results if r.method == method and r.concurrency == level]
            out.setdefault(method, {})[str(level)] = _method_summary(rows)
    return out


def _method_summary(rows: list[RunResult]) -> dict:
    speedups = [r.speedup for r in rows if r.speedup > 0]
    steps = sum(r.num_steps for r in rows)
    drafted = sum(r.num_draft_tokens for r in rows)
    drafts = sum(r.num_drafts for r in rows)
    accepted = sum(r.num_accepted_tokens for r in rows)
    same = [r.identical_to_plain for r in rows]
    return {
        "geomean_speedup": round(_geomean(speedups), 3),
        "min_speedup": min(speedups, default=0.0), "max_speedup": max(speedups, default=0.0),
        "mean_accepted_length": round(1 + accepted / steps, 3) if steps and drafted else 1.0,
        "mean_accepted_length_per_draft": round(1 + accepted / drafts, 3) if drafts else 1.0,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        "identical_to_plain": None if None in same else sum(same),
        "num_prompts": sum(r.num_prompts for r in rows),
    }


def _peers(peers: list[PeerResult]) -> dict:
    out: dict[str, dict] = {}
    for name in dict.fromkeys(p.name for p in peers):
        mine = [p for p in peers if p.name == name]
        total = _pooled(mine)
        flags = [p.interference for p in mine]
        out[name] = {
            "kind": mine[0].kind, "method": mine[0].method, **mine[0].detail,
            "decode_tok_s": total.decode_tok_s, "decode_tok_s_best": total.decode_tok_s_best,
            "prefill_tok_s": round(statistics.median(p.prefill_tok_s for p in mine), 1),
            "num_prompts": sum(p.num_prompts for p in mine),
            "interference": None if None in flags else any(flags),
            "per_category": {p.category: {"decode_tok_s": p.decode_tok_s,
                                          "decode_tok_s_best": p.decode_tok_s_best,
                                          "num_prompts": p.num_prompts,
                                          "generated_tokens": p.generated_tokens} for p in mine},
        }
    return out


def _pooled(peers: list[PeerResult]) -> PeerResult:
    """All categories of one peer as one: per repeat, tokens and times summed."""
    repeats = min(len(p.decode_tokens) for p in peers)
    return PeerResult(peers[0].name, peers[0].kind, peers[0].method, "all",
                      sum(p.num_prompts for p in peers), sum(p.generated_tokens for p in peers),
                      [sum(p.decode_tokens[i] for p in peers) for i in range(repeats)],
                      [sum(p.decode_time_s[i] for p in peers) for i in range(repeats)])


# ---- text --------------------------------------------------------------------------------------

def markdown_table(report: dict) -> str:
    head = ["category", "method", "conc", "decode tok/s", "best tok/s", "speedup", "acc.len",
            "acc.len/draft", "acc.rate", "draft share", "same as plain", "prefill tok/s",
            "interference"]
    rows = []
    for r in report["results"]:
        same = "—" if r["identical_to_plain"] is None else f"{r['identical_to_plain']}/{r['num_prompts']}"
        rows.append([r["category"], r["method"], str(r["concurrency"]), f"{r['decode_tok_s']:.1f}",
                     f"{r['decode_tok_s_best']:.1f}", f"{r['speedup']:.2f}x",
                     f"{r['mean_accepted_length']:.2f}",
                     f"{r.get('mean_accepted_length_per_draft', 1.0):.2f}",
                     f"{r['acceptance_rate']:.2f}", f"{100 * r['draft_time_share']:.1f}%", same,
                     f"{r['prefill_tok_s']:.0f}",
                     "yes" if r["interference"] else ""])
    if any(r.get("mean_accepted_length_ci") for r in report["results"]):
        head.append("acc.len 95% CI")
        for row, r in zip(rows, report["results"]):
            row.append(_interval_text(r.get("mean_accepted_length_ci")))
    if any(r.get("speedup_ci") for r in report["results"]):
        head.append("speedup 95% CI")
        for row, r in zip(rows, report["results"]):
            row.append(_interval_text(r.get("speedup_ci")))
    if any(r.get("vs_untuned") is not None for r in report["results"]):
        head.append("vs untuned")
        for row, r in zip(rows, report["results"]):
            ci = r.get("vs_untuned_ci")
            row.append("—" if r.get("vs_untuned") is None else
                       f"{r['vs_untuned']:.3f}x" + (f" ({_interval_text(ci)})" if ci else ""))
    return markdown(head, rows)


def _interval_text(ci: list[float] | None) -> str:
    return "—" if not ci else f"{ci[0]:.3f}-{ci[1]:.3f}"


def peers_table(report: dict) -> str:
    head = ["category", "peer", "peer tok/s", "speculant plain ÷ peer", "best method",
            "best ÷ peer"]
    rows = []
    for cat, c in report["categories"].items():
        for name, p in c["peers"].items():
            rows.append([cat, name, f"{p['decode_tok_s']:.1f}", f"{p['ratio_plain']:.2f}x",
                         p["best_method"], f"{p['ratio_best']:.2f}x"])
    return markdown(head, rows) if rows else ""


def markdown(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in rows)])


def summary_text(report: dict) -> str:
    """A few lines a person reads at a glance."""
    m = report["machine"]
    lines = [f"Summary ({report['date']}, {m['cpu']}, {m['num_cpus']} cores, threads={m['threads']}; "
             f"median decode tok/s):"]
    for cat, by_level in report["summary"].items():
        for level, b in by_level.items():
            same = ("n/a" if b["identical_to_plain"] is None
                    else f"{b['identical_to_plain']}/{b['num_prompts']}")
            verdict = "faster than plain" if b["speedup"] > 1 else "NOT faster than plain"
            lines.append(f"  {cat:<16} c={level:<3} best {b['method']:<24} {b['speedup']:5.2f}x "
                         f"({verdict}), acc.len {b['mean_accepted_length']:.2f}, "
                         f"outputs identical to plain {same}")
    for name, p in report["peers"].items():
        ratios = [c["peers"][name] for c in report["categories"].values() if name in c["peers"]]
        lines.append(f"  peer {name}: {p['decode_tok_s']:.1f} tok/s over {p['num_prompts']} prompts; "
                     f"speculant plain {_geomean(r['ratio_plain'] for r in ratios):.2f}x, "
                     f"best {_geomean(r['ratio_best'] for r in ratios):.2f}x (geomean over categories)")
    flagged = sum(r["interference"] for r in report["results"])
    lines.append(f"  interference: {flagged} of {len(report['results'])} measurements flagged "
                 f"(other processes used the CPU; see other_cpu_cores in the JSON)"
                 if report["interference"] else "  interference: none detected")
    return "\n".join(lines)


def _geomean(values) -> float:
    logs = [math.log(v) for v in values if v > 0]
    return math.exp(statistics.fmean(logs)) if logs else 0.0


# ---- chart and files -------------------------------------------------------------------------

def write_chart(report: dict, path: str) -> str:
    """Speedup over plain (top) and decode tok/s with peers (bottom), one column per concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = report["concurrency"]
    cats = list(report["categories"])
    names = [*report["methods"], *report["peers"]]
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}  # same color per series
    fig, axes = plt.subplots(2, len(levels), figsize=(max(7, 1.1 * len(cats) + 4) * len(levels), 8),
                             squeeze=False)
    for col, level in enumerate(levels):
        key = str(level)
        spec = [m for m in report["methods"] if m != PLAIN]
        _bars(axes[0][col], cats, {m: [_cell(report, c, m, key, "speedup") for c in cats] for m in spec},
              colors)
        axes[0][col].axhline(1.0, color="black", linewidth=0.8)
        axes[0][col].set_title(f"speedup over plain, concurrency {level}")
        series = {m: [_cell(report, c, m, key, "decode_tok_s") for c in cats] for m in report["methods"]}
        if col == 0:
            for name in report["peers"]:
                series[name] = [report["categories"][c]["peers"].get(name, {}).get("decode_tok_s", 0.0)
                                for c in cats]
        _bars(axes[1][col], cats, series, colors)
        peers_note = " (peers: one request at a time)" if col == 0 and report["peers"] else ""
        axes[1][col].set_title(f"decode tokens/s, concurrency {level}{peers_note}")
    m = report["machine"]
    flag = " — interference flagged" if report["interference"] else ""
    fig.suptitle(f"speculant bench {report['date'][:16]} — {m['cpu']}, {m['num_cpus']} cores, "
                 f"threads={m['threads']} — {os.path.basename(str(report['model']))}, "
                 f"max {report['max_tokens']} tokens{flag}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _cell(report: dict, cat: str, method: str, level: str, key: str) -> float:
    return report["categories"][cat]["methods"].get(method, {}).get(level, {}).get(key, 0.0)


def _bars(ax, cats: list[str], series: dict[str, list[float]], colors: dict) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(cats))], values,
               width, label=name, color=colors[name])
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    if series:
        ax.legend(fontsize=8)


def write_outputs(report: dict, out_dir: str, prefix: str = "bench", chart: bool = True) -> dict:
    """Write the chart and the JSON into `out_dir`, named by the run's date; returns `files`."""
    os.makedirs(out_dir, exist_ok=True)
    stamp = datetime.fromisoformat(report["date"]).strftime("%Y%m%d-%H%M%S")
    base = os.path.join(out_dir, f"{prefix}-{stamp}")
    files = {"json": base + ".json", "chart": write_chart(report, base + ".png") if chart else None}
    report["files"] = files
    with open(files["json"], "w") as f:
        json.dump(report, f, indent=1)
    return files


def now_iso() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def emit_report(report: dict, args, sections: list[str], prefix: str = "bench",
                chart: bool = True) -> None:
    """Files first (their paths go into the JSON), then the text, then the JSON line last."""
    try:
        write_outputs(report, args.out_dir, prefix, chart)
    except ImportError as exc:  # matplotlib is in the `bench` extra
        from tqdm import tqdm

        tqdm.write(f"warning: no chart ({exc}); install speculant[bench]", file=sys.stderr)
        write_outputs(report, args.out_dir, prefix, chart=False)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    files = report["files"]
    sections = [s for s in sections if s]
    sections.append(f"Wrote {files['json']}" + (f" and {files['chart']}" if files["chart"] else ""))
    print("\n\n".join(sections))
    print(json.dumps(report), flush=True)
