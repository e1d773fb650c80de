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

Usage: python -m speculant.spec.replay --records FILE.jsonl --spec-type NAME [--n-max N]
       [--set FIELD=VALUE ...]; the last stdout line is one JSON object with the totals.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field

from speculant.spec.base import (
    CommittedTokens,
    DraftParams,
    DraftRequest,
    Speculator,
    SpeculatorContext,
    speculator_class,
)
from speculant.spec.ngram_match import common_prefix_len


@dataclass(slots=True)
class ReplayStats:
    num_records: int = 0
    num_generated: int = 0  # output tokens replayed
    steps: int = 0  # target forwards
    num_drafts: int = 0  # non-empty drafts proposed (all verified here)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted at draft position i

    @property
    def mean_accepted_length(self) -> float:
        return self.num_generated / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def add(self, other: ReplayStats) -> None:
        self.num_records += other.num_records
        self.num_generated += other.num_generated
        self.steps += other.steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        _add_per_pos(self.accepted_per_pos, other.accepted_per_pos)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["mean_accepted_length"] = self.mean_accepted_length
        out["acceptance_rate"] = self.acceptance_rate
        return out


def _add_per_pos(total: list[int], more: list[int]) -> None:
    if len(more) > len(total):
        total.extend([0] * (len(more) - len(total)))
    for i, n in enumerate(more):
        total[i] += n


def replay_record(spec: Speculator, prompt_ids: list[int], output_ids: list[int],
                  params: DraftParams, seq_id: int = 0) -> ReplayStats:
    """Replay one record through `spec`; returns its statistics."""
    stats = ReplayStats(num_records=1, num_generated=len(output_ids))
    spec.begin(seq_id, prompt_ids)
    try:
        # 1) prefill: the target commits the prompt and samples output[0]
        spec.process([CommittedTokens(seq_id, 0, list(prompt_ids))])
        history = list(prompt_ids) + list(output_ids[:1])
        stats.steps = 1 if output_ids else 0
        done = len(output_ids[:1])
        # 2) decode: draft, verify against the record, commit sampled + accepted tokens
        while done < len(output_ids):
            room = len(output_ids) - done - 1  # leave the last token to the target
            n_max = min(params.n_max, room)
            step_params = DraftParams(n_max, min(params.n_min, n_max), params.p_min)
            draft = spec.draft([DraftRequest(seq_id, list(history), step_params)]).get(seq_id)
            num_acc = 0
            if draft is not None and len(draft) > 0:
                draft_ids = draft.token_ids[:step_params.n_max]
                num_acc = common_prefix_len(draft_ids, output_ids[done:])  # greedy verification
                spec.accept(seq_id, num_acc, False)
                stats.num_drafts += 1
                stats.num_draft_tokens += len(draft_ids)
                stats.num_accepted_tokens += num_acc
                _add_per_pos(stats.accepted_per_pos, [1] * num_acc)
            new_ids = list(output_ids[done:done + num_acc + 1])
            committed = [history[-1]] + new_ids[:num_acc]
            spec.process([CommittedTokens(seq_id, len(history) - 1, committed)])
            history.extend(new_ids)
            done += len(new_ids)
            stats.steps += 1
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
        print(f"record {i}: {stats.num_generated} tokens, {stats.steps} steps, "
              f"mean accepted length {stats.mean_accepted_length:.3f}")
    summary = {"spec_type": args.spec_type, **total.to_dict()}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
