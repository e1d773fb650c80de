"""Prompt files in the schema of `shared/data/prompts_dev.jsonl`.

`{"id", "category", "mode": "chat"|"completion", "turns": [...]}`: chat turns are user messages
sent through the model's chat template (turn 2 after the model's own answer to turn 1);
completion records continue `turns[0]` as raw text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(slots=True)
class PromptRecord:
    id: str
    category: str
    mode: str
    turns: list[str]


def read_prompts(path: str, categories: list[str] | None = None, limit: int | None = None) -> list[PromptRecord]:
    """Read records; `limit` applies per category (a sample of each), in file order."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except OSError as exc:
        raise FileNotFoundError(f"cannot read prompts file {path!r}: {exc.strerror}") from exc
    records, per_category = [], {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        rec = _parse(line, path, lineno)
        if categories and rec.category not in categories:
            continue
        if limit is not None and per_category.get(rec.category, 0) >= limit:
            continue
        per_category[rec.category] = per_category.get(rec.category, 0) + 1
        records.append(rec)
    if categories:
        missing = sorted(set(categories) - set(per_category))
        if missing:
            raise ValueError(f"{path}: no prompts in categories {missing}")
    return records


def _parse(line: str, path: str, lineno: int) -> PromptRecord:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
    turns = obj.get("turns")
    if isinstance(obj.get("prompt"), str) and turns is None:
        turns = [obj["prompt"]]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise ValueError(f"{path}:{lineno}: 'turns' must be a non-empty list of strings")
    mode = obj.get("mode", "chat")
    if mode not in ("chat", "completion"):
        raise ValueError(f"{path}:{lineno}: mode must be 'chat' or 'completion', got {mode!r}")
    return PromptRecord(id=str(obj.get("id", f"line-{lineno}")),
                        category=str(obj.get("category", "default")), mode=mode, turns=turns)


def first_turn_prompt(record: PromptRecord, tokenizer) -> str:
    """The text sent for the record's first turn."""
    if record.mode == "completion":
        return record.turns[0]
    return tokenizer.apply_chat_template([{"role": "user", "content": record.turns[0]}])


def next_turn_prompt(record: PromptRecord, tokenizer, answers: list[str]) -> str:
    """The prompt for turn len(answers)+1 of a chat record, with the model's earlier answers."""
    messages = []
    for turn, answer in zip(record.turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": record.turns[len(answers)]})
    return tokenizer.apply_chat_template(messages)
