"""Offline replay: measure a speculator's acceptance on recorded outputs, without a model.

After Arctic Inference's `suffix_decoding/simulator.py`. Greedy verification is simulated by
the record itself: the target "accepts" the longest draft prefix that matches the recorded
output and then produces the next recorded token. The speculator sees the calls an engine
makes, in the engine's order:

    begin(prompt) -> process(prompt)                   # prefill: target forward 1 -> output[0]
    loop: draft(history) -> accept(n) -> process(sampled + accepted)   # one target forward each
    end()

Vocabulary (as vLLM's metrics): a *step* is one target forward (the prefill included), so
mean accepted length = generated tokens / steps, 1.0 without speculation.

Usage: python -m speculant.speculators.replay --records FILE.jsonl --spec-type NAME [--n-max N]
       [--set FIELD=VALUE ...]; the last stdout line is one JSON object with the totals.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass

from speculant.speculators.base import (
    CommittedTokens,
    DraftParams,
    DraftRequest,
    Speculator,
    SpeculatorContext,
)
from speculant.speculators.counters import AcceptanceCounters
from speculant.speculators.registry import speculator_class
from speculant.speculators.ngram_match import common_prefix_len


@dataclass(slots=True)
class ReplayStats(AcceptanceCounters):
    """Counters of replayed records. As in the engine, `num_steps` counts decode steps: the
    first output token comes from the prefill, every later step yields its accepted tokens
    plus one target token, so num_generated = num_records_decoded + num_steps + accepted."""

    num_records: int = 0
    num_generated: int = 0  # output tokens replayed
    num_decoded: int = 0  # of those, tokens produced by decode steps (all but each first token)

    def add(self, other: AcceptanceCounters) -> None:
        AcceptanceCounters.add(self, other)
        if isinstance(other, ReplayStats):
            self.num_records += other.num_records
            self.num_generated += other.num_generated
            self.num_decoded += other.num_decoded

    def to_dict(self) -> dict:
        return {"num_records": self.num_records, "num_generated": self.num_generated,
                "num_decoded": self.num_decoded, **self.summary()}


def replay_record(spec: Speculator, prompt_ids: list[int], output_ids: list[int],
                  params: DraftParams, seq_id: int = 0) -> ReplayStats:
    """Replay one record through `spec`; returns its statistics."""
    stats = ReplayStats(num_records=1, num_generated=len(output_ids))
    spec.begin(seq_id, prompt_ids)
    try:
        # 1) prefill: the target commits the prompt and samples output[0]
        spec.process([CommittedTokens(seq_id, 0, list(prompt_ids),
                                      output_ids[0] if output_ids else None)])
        history = list(prompt_ids) + list(output_ids[:1])
        done = len(output_ids[:1])
        stats.num_decoded = len(output_ids) - done
        # 2) decode: draft, verify against the record, commit sampled + accepted tokens
        while done < len(output_ids):
            room = len(output_ids) - done - 1  # leave the last token to the target
            n_max = min(params.n_max, room)
            step_params = DraftParams(n_max, min(params.n_min, n_max), params.p_min)
            draft = spec.draft([DraftRequest(seq_id, list(history), step_params,
                                             num_prompt_tokens=len(prompt_ids))]).get(seq_id)
            num_acc = 0
            if draft is not None and len(draft) > 0:
                draft_ids = draft.token_ids[:step_params.n_max]
                num_acc = common_prefix_len(draft_ids, output_ids[done:])  # greedy verification
                spec.accept(seq_id, num_acc, False)
                stats.record_draft(len(draft_ids), num_acc)
            new_ids = list(output_ids[done:done + num_acc + 1])
            committed = [history[-1]] + new_ids[:num_acc]
            spec.process([CommittedTokens(seq_id, len(history) - 1, committed, new_ids[-1])])
            history.extend(new_ids)
            done += len(new_ids)
            stats.record_step()
    finally:
        spec.end(seq_id)
    return stats


def replay(spec: Speculator, records: list[dict],
           params: DraftParams) -> tuple[list[ReplayStats], ReplayStats]:
    """Replay records in order through one speculator (state shared across records, as in a
    server); returns per-record statistics and their total."""
    per_record, total = [], ReplayStats()
    for i, rec in enumerate(records):
        stats = replay_record(spec, rec["prompt_ids"], rec["output_ids"], params, seq_id=i)
        per_record.append(stats)
        total.add(stats)
    return per_record, total


def load_records(path: str) -> list[dict]:
    """Records from a JSONL file (one object per line) or a JSON list."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    for i, rec in enumerate(records):
        if "prompt_ids" not in rec or "output_ids" not in rec:
            raise ValueError(f"{path}: record {i} lacks prompt_ids or output_ids")
    return records


def _parse_options(config_class, pairs: list[str]) -> dict:
    types = {f.name: f.type for f in dataclasses.fields(config_class)}
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in types:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE, FIELD one of {sorted(types)}")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}
        options[name] = kind.get(str(types[name]), str)(value)
    return options


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", required=True, help="JSONL of {prompt_ids, output_ids}")
    ap.add_argument("--spec-type", required=True, help="registered speculator name")
    ap.add_argument("--n-max", type=int, default=16)
    ap.add_argument("--n-min", type=int, default=0)
    ap.add_argument("--p-min", type=float, default=0.0)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="speculator config field (repeatable)")
    args = ap.parse_args(argv)
    records = load_records(args.records)
    cls = speculator_class(args.spec_type)
    config_class = getattr(cls, "config_class", None)
    config = config_class(**_parse_options(config_class, args.set)) if config_class else None
    vocab_size = 1 + max((max(r["prompt_ids"] + r["output_ids"], default=0) for r in records),
                         default=0)
    spec = cls(SpeculatorContext(vocab_size=vocab_size), config)
    per_record, total = replay(spec, records, DraftParams(args.n_max, args.n_min, args.p_min))
    for i, stats in enumerate(per_record):
        print(f"record {i}: {stats.num_generated} tokens, {stats.num_steps} steps, "
              f"mean accepted length {stats.mean_accepted_length:.3f}")
    summary = {"spec_type": args.spec_type, **total.to_dict()}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
