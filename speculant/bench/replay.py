"""`speculant bench --replay RECORDS.jsonl --spec-type "a,b;c"`: acceptance without the model.

Records are `{"id", "category", "prompt_ids", "output_ids"}` (what `speculant bench --record`
writes; `id` and `category` are optional). Each ';'-separated chain of --spec-type replays every
category's records through `speculant.speculators.replay`, driven through a `SpeculatorChain` as the
engine drives it (every member proposes, the chain picks and trims the winner), with fresh
speculator state per chain and category and the records of a category in file order (state such
as the suffix drafter's global tree carries from one record to the next, as in a server).

Differences from a real run: greedy verification is simulated by the record; the chain prices a
draft token with a fixed row cost (`--replay-row-cost`, default the engine's prior
`StepCostModel`) instead of the engine's fitted one; model drafters (`is_model_based`) are refused.

est_speedup = decode tokens / (verification steps + row_cost x draft tokens): decode tokens/s
relative to plain decoding if a step with k draft tokens costs 1 + k x row_cost plain steps and
drafting is free. On this CPU a verified row costs ~0.15-0.3 of a step (more at long contexts,
where each row also attends over the whole prompt), so `--replay-row-cost 0.2` is realistic.

JSON (last stdout line, and `bench-replay-<date>.json` in --out-dir):
  schema        "speculant-bench-replay/1"
  date, records (the file), n_max, row_cost, methods [chain],
  categories    {category: num_records}
  results       [{"category", "method", "num_records", "num_generated", "num_steps",
                  "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                  "mean_accepted_length" (1 + accepted / verification steps, as the engine),
                  "est_speedup", "acceptance_rate", "accepted_per_pos",
                  "spec_ms_per_step" (replay time per step: every speculator call, begin to end)}]
  summary       {category: {"method", "mean_accepted_length", "acceptance_rate"}}: the chain
                with the longest mean accepted length
  files         {"json": path, "chart": null}
"""
from __future__ import annotations

import sys
import time
from types import SimpleNamespace

from speculant.speculators.base import (
    CommittedTokens,
    Draft,
    DraftParams,
    DraftRequest,
    Speculator,
    SpeculatorContext,
)
from speculant.speculators.registry import speculator_class
from speculant.speculators.chain import SpeculatorChain
from speculant.speculators.replay import ReplayStats, load_records, replay_record

SCHEMA = "speculant-bench-replay/1"


class ChainDrafter(Speculator):
    """A `SpeculatorChain` behind the single-speculator contract, so the replay simulator drives
    the chain exactly where the engine would."""

    name = "chain"

    def __init__(self, chain: SpeculatorChain, types: tuple[str, ...], cost_per_token: float):
        self.chain, self.types, self.cost_per_token = chain, types, cost_per_token

    def begin(self, seq_id: int, prompt_ids: list[int]) -> None:
        self.chain.begin(seq_id, prompt_ids, self.types)

    def process(self, batch: list[CommittedTokens]) -> None:
        self.chain.process(batch)

    def draft(self, requests: list[DraftRequest]) -> dict[int, Draft]:
        return self.chain.draft(requests, self.cost_per_token)

    def accept(self, seq_id: int, num_accepted: int, is_other: bool) -> None:
        self.chain.accept(seq_id, num_accepted)

    def end(self, seq_id: int) -> None:
        self.chain.end(seq_id)


def default_row_cost() -> float:
    from speculant.engine.step_cost import StepCostModel

    return StepCostModel().cost_per_token(1)


def build_chain(types: list[str], vocab_size: int, spec_options: dict,
                row_cost: float) -> ChainDrafter:
    from speculant.speculators.factory import create_speculators

    for name in types:
        if speculator_class(name).is_model_based:
            raise ValueError(f"--replay measures model-free speculators; {name!r} runs a model")
    config = SimpleNamespace(spec_type=list(types), spec_options=spec_options)
    speculators = create_speculators(config, SpeculatorContext(vocab_size=vocab_size))
    return ChainDrafter(SpeculatorChain(speculators), tuple(types), row_cost)


def replay_category(drafter: ChainDrafter, records: list[dict], params: DraftParams,
                    bar=None) -> tuple[ReplayStats, float]:
    """All records through one drafter, in order; (total statistics, seconds it took)."""
    total = ReplayStats()
    t0 = time.perf_counter()
    for i, rec in enumerate(records):
        total.add(replay_record(drafter, rec["prompt_ids"], rec["output_ids"], params, seq_id=i))
        if bar is not None:
            bar.update()
    return total, time.perf_counter() - t0


def est_speedup(num_decoded: int, num_steps: int, num_draft_tokens: int, row_cost: float) -> float:
    """Plain decoding takes one step per decoded token; speculation takes `num_steps` steps of
    1 + row_cost x (their draft tokens) plain steps each."""
    cost = num_steps + row_cost * num_draft_tokens
    return num_decoded / cost if cost > 0 else 1.0


def result_row(category: str, method: str, stats: ReplayStats, seconds: float,
               row_cost: float) -> dict:
    """One row of the replay JSON (counters as the engine counts them: decode steps only)."""
    return {"category": category, "method": method, "num_records": stats.num_records,
            "num_generated": stats.num_generated, **stats.summary(3),
            "est_speedup": round(est_speedup(stats.num_decoded, stats.num_steps,
                                             stats.num_draft_tokens, row_cost), 3),
            "spec_ms_per_step": round(1e3 * seconds / stats.num_steps, 3) if stats.num_steps else 0.0}


def group_records(records: list[dict], categories: list[str] | None,
                  limit: int | None) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for rec in records:
        cat = str(rec.get("category", "default"))
        if categories and cat not in categories:
            continue
        if limit is None or len(groups.get(cat, [])) < limit:
            groups.setdefault(cat, []).append(rec)
    if categories and sorted(set(categories) - set(groups)):
        raise ValueError(f"no records in categories {sorted(set(categories) - set(groups))}")
    return groups


def run_replay(args) -> int:
    from tqdm import tqdm

    from speculant.bench.options import merge_spec_options, parse_method_specs
    from speculant.bench.report import emit_report
    from speculant.bench.report import now_iso
    from speculant.cli.options import parse_spec_options

    specs = [spec for spec in parse_method_specs(args.spec_type) if spec[1]]
    methods = [(name, types) for name, types, _ in specs]
    if not methods:
        raise ValueError("--replay needs --spec-type with at least one speculator")
    records = load_records(args.replay)
    groups = group_records(records, args.categories.split(",") if args.categories else None,
                           args.limit)
    vocab_size = 1 + max((max(r["prompt_ids"] + r["output_ids"], default=0) for r in records), default=0)
    params = DraftParams(args.spec_n_max, args.spec_n_min, args.spec_p_min)
    options = parse_spec_options(args.spec_option)
    row_cost = default_row_cost() if args.replay_row_cost is None else args.replay_row_cost
    date = now_iso()
    bar = tqdm(total=len(methods) * sum(map(len, groups.values())), desc="replay", unit="record",
               file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    rows = []
    for name, types, own in specs:
        for cat, recs in groups.items():
            bar.set_postfix_str(f"{cat} {name}")
            chain = build_chain(types, vocab_size, merge_spec_options(options, own), row_cost)
            stats, seconds = replay_category(chain, recs, params, bar)
            rows.append(result_row(cat, name, stats, seconds, row_cost))
    bar.close()
    report = {"schema": SCHEMA, "date": date, "records": args.replay, "n_max": args.spec_n_max,
              "row_cost": round(row_cost, 4),
              "methods": [n for n, _ in methods],
              "method_options": {n: own for n, _, own in specs if own},
              "categories": {cat: len(recs) for cat, recs in groups.items()},
              "results": rows, "summary": _best(rows), "files": {"json": None, "chart": None}}
    emit_report(report, args, [replay_table(rows), replay_summary(report["summary"])],
                prefix="bench-replay", chart=False)
    return 0


def _best(rows: list[dict]) -> dict:
    out = {}
    for row in rows:
        best = out.get(row["category"])
        if best is None or row["mean_accepted_length"] > best["mean_accepted_length"]:
            out[row["category"]] = {k: row[k] for k in ("method", "mean_accepted_length",
                                                         "acceptance_rate")}
    return out


def replay_table(rows: list[dict]) -> str:
    from speculant.bench.report import markdown

    head = ["category", "method", "records", "tokens", "acc.len", "est. speedup", "acc.rate",
            "drafts", "spec ms/step"]
    return markdown(head, [[r["category"], r["method"], str(r["num_records"]),
                            str(r["num_generated"]), f"{r['mean_accepted_length']:.2f}",
                            f"{r['est_speedup']:.2f}x",
                            f"{r['acceptance_rate']:.2f}", str(r["num_drafts"]),
                            f"{r['spec_ms_per_step']:.3f}"] for r in rows])


def replay_summary(best: dict) -> str:
    lines = ["Summary (replay, no model; longest mean accepted length per category):"]
    lines += [f"  {cat:<16} {b['method']:<24} acc.len {b['mean_accepted_length']:.2f}, "
              f"acceptance {b['acceptance_rate']:.2f}" for cat, b in best.items()]
    return "\n".join(lines)
