"""`speculant generate`: text for a prompt or a prompt file, streamed or as JSON lines."""
from __future__ import annotations

import json
import sys
import time

from speculant.cli.options import engine_options, sampling_params
from speculant.data.prompt_set import PromptRecord, first_turn_prompt, next_turn_prompt, read_prompts
from speculant.engine.request_output import RequestOutput
from speculant.speculators.counters import total


def run_generate(args) -> int:
    from speculant.llm import LLM

    if args.prompt is None and args.prompts is None:
        raise ValueError("give a PROMPT or --prompts FILE.jsonl")
    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    records = _records(args)
    params = sampling_params(args)
    t_load = time.perf_counter()
    llm = LLM(args.model, **engine_options(args, max_num_seqs=args.batch))
    load_s = time.perf_counter() - t_load
    if not args.json:
        print(f"[speculant] loaded {llm.engine.model_path} in {load_s:.2f} s", file=sys.stderr)
    streamer = None if args.json or args.batch > 1 or len(records) > 1 else _Streamer(llm)
    t0 = time.perf_counter()
    results = _run_records(llm, records, params, args, streamer)
    wall_s = time.perf_counter() - t0
    llm.engine.save_speculators()  # e.g. ngram_cache's dynamic table, when it names a file
    for record, outs in results:
        if args.json:
            print(json.dumps(_json_object(record, outs)), flush=True)
        elif streamer is None:
            print(f"=== {record.id}\n" + "\n\n".join(o.text for o in outs), flush=True)
    if not args.json:
        _print_summary(llm, [o for _, outs in results for o in outs], wall_s)
    return 0


def _records(args) -> list[PromptRecord]:
    if args.prompts is not None:
        cats = args.categories.split(",") if args.categories else None
        return read_prompts(args.prompts, cats, args.limit)
    mode = "completion" if args.raw else "chat"
    return [PromptRecord(id="prompt", category="cli", mode=mode, turns=[args.prompt])]


def _run_records(llm, records, params, args, streamer):
    """All first turns together, then all second turns (each after its record's own answer)."""
    answers: dict[int, list[RequestOutput]] = {i: [] for i in range(len(records))}
    max_turns = max(len(r.turns) if r.mode == "chat" else 1 for r in records)
    for turn in range(max_turns):
        todo = [i for i, r in enumerate(records) if turn < (len(r.turns) if r.mode == "chat" else 1)]
        prompts = [first_turn_prompt(records[i], llm.tokenizer) if turn == 0 else
                   next_turn_prompt(records[i], llm.tokenizer, [o.text for o in answers[i]])
                   for i in todo]
        outs = llm.generate(prompts, params, on_update=streamer)
        for i, out in zip(todo, outs):
            answers[i].append(out)
        if streamer is not None:
            streamer.end_turn()
    return [(records[i], answers[i]) for i in range(len(records))]


def _json_object(record: PromptRecord, outs: list[RequestOutput]) -> dict:
    time_s = sum(o.time_s for o in outs)
    num_generated = sum(o.num_generated for o in outs)
    decode_s = sum(o.decode_time_s for o in outs)
    return {
        "id": record.id,
        "category": record.category,
        "text": "\n\n".join(o.text for o in outs),
        "turns": [o.text for o in outs],
        "token_ids": [t for o in outs for t in o.token_ids],
        "num_prompt_tokens": sum(o.num_prompt_tokens for o in outs),
        "num_generated": num_generated,
        "time_s": round(time_s, 4),
        "tokens_per_s": round(num_generated / time_s, 2) if time_s > 0 else 0.0,
        "queue_time_s": round(sum(o.queue_time_s for o in outs), 4),
        "prefill_time_s": round(sum(o.prefill_time_s for o in outs), 4),
        "decode_time_s": round(decode_s, 4),
        "decode_tokens_per_s": round(sum(o.num_generated - 1 for o in outs if o.num_generated)
                                     / decode_s, 2) if decode_s > 0 else 0.0,
        "finish_reason": outs[-1].finish_reason,
        "spec": _merge_spec(outs),
    }


def _merge_spec(outs: list) -> dict:
    """The `spec` object of a multi-turn record: the last turn's fields, every turn's counts."""
    if len(outs) == 1:
        return outs[0].spec
    return {**outs[-1].spec, **total(o.counters for o in outs).summary()}


class _Streamer:
    """Prints a single request's text as tokens arrive: each update carries the text its
    tokens completed (incremental detokenization, stop strings already cut)."""

    def __init__(self, llm):
        self.llm = llm

    def __call__(self, update) -> None:
        if update.new_text:
            sys.stdout.write(update.new_text)
            sys.stdout.flush()

    def end_turn(self) -> None:
        sys.stdout.write("\n")


def _print_summary(llm, outs: list[RequestOutput], wall_s: float) -> None:
    from speculant.cli.stats_table import format_speculator_table

    num_gen = sum(o.num_generated for o in outs)
    num_prompt = sum(o.num_prompt_tokens for o in outs)
    prefill_s = sum(o.prefill_time_s for o in outs)
    print(f"\n[speculant] {len(outs)} request(s): {num_prompt} prompt tokens, {num_gen} generated "
          f"in {wall_s:.2f} s -> {num_gen / wall_s:.1f} tok/s"
          + (f" (prefill {num_prompt / prefill_s:.0f} tok/s)" if prefill_s > 0 else ""))
    if llm.engine.speculator_names:
        print(format_speculator_table(llm.engine.speculator_stats(), llm.engine.stats))
