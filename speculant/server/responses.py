"""Response bodies: OpenAI completions / chat completions (whole and streamed), usage, timings.

`timings` follows llama-server (`prompt_n`, `prompt_ms`, `predicted_n`, ..., `draft_n`,
`draft_n_accepted`) and adds the speculation statistics in vLLM's vocabulary: verified drafts
(`num_drafts`), mean accepted length (1 + accepted / verification steps) and the number of drafts
accepted at each draft position (`accepted_per_pos`).
"""
from __future__ import annotations

import json
import time
import uuid

from speculant.engine.request_output import spec_summary


def request_timings(seq) -> dict:
    """Timings and speculation statistics of one request (read on the engine thread)."""
    prompt_ms = seq.prefill_time_s * 1e3
    first, end = seq.first_token_time, seq.finish_time or time.perf_counter()
    predicted_ms = (end - first) * 1e3 if first is not None else 0.0
    spec = spec_summary(seq)
    # Generation speed counts the tokens after the first one (the first comes with the prompt).
    num_after_first = max(seq.num_generated - 1, 0)
    per_token_ms = predicted_ms / num_after_first if num_after_first else 0.0
    return {
        "prompt_n": seq.num_prompt,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / seq.num_prompt, 3) if seq.num_prompt else 0.0,
        "prompt_per_second": round(seq.num_prompt / prompt_ms * 1e3, 2) if prompt_ms else 0.0,
        "predicted_n": seq.num_generated,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(per_token_ms, 3),
        "predicted_per_second": round(1e3 / per_token_ms, 2) if per_token_ms else 0.0,
        "draft_n": spec["num_draft_tokens"],
        "draft_n_accepted": spec["num_accepted_tokens"],
        "num_drafts": spec["num_drafts"],
        "acceptance_rate": spec["acceptance_rate"],
        "mean_accepted_length": spec["mean_accepted_length"],
        "mean_accepted_length_per_draft": spec["mean_accepted_length_per_draft"],
        "accepted_per_pos": spec["accepted_per_pos"],
        "spec_types": list(seq.spec_types),
        "per_speculator": spec["per_speculator"],
    }


def usage(num_prompt: int, num_generated: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated}


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def stream_safe_end(text: str, stops: list[str]) -> int:
    """How much of a still-growing `text` can be sent: never a trailing partial UTF-8 character
    (decoded as U+FFFD) nor a tail that could be the start of a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), held, -1):
            if text.endswith(stop[:k], 0, end):
                held = k
                break
    return end - held


class CompletionFormat:
    """`/v1/completions` bodies for one request."""

    object = "text_completion"

    def __init__(self, model: str):
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())

    def _envelope(self, obj: str, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], **extra}

    def body(self, text: str, finish_reason: str, use: dict, timings: dict) -> dict:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope(self.object, choice, usage=use, timings=timings)

    def opening_chunks(self) -> list[dict]:
        return []

    def chunk(self, text: str, finish_reason: str | None = None, **extra) -> dict:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope(self.object, choice, **extra)

    def usage_chunk(self, use: dict) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created,
                "model": self.model, "choices": [], "usage": use}


class ChatFormat(CompletionFormat):
    """`/v1/chat/completions` bodies for one request."""

    object = "chat.completion"

    def __init__(self, model: str):
        super().__init__(model)
        self.id = f"chatcmpl-{self.id.removeprefix('cmpl-')}"

    def body(self, text: str, finish_reason: str, use: dict, timings: dict) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": finish_reason, "logprobs": None}
        return self._envelope(self.object, choice, usage=use, timings=timings)

    def opening_chunks(self) -> list[dict]:
        return [self._delta({"role": "assistant", "content": ""})]

    def chunk(self, text: str, finish_reason: str | None = None, **extra) -> dict:
        return self._delta({"content": text} if text or finish_reason is None else {},
                           finish_reason, **extra)

    def _delta(self, delta: dict, finish_reason: str | None = None, **extra) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("chat.completion.chunk", choice, **extra)

    def usage_chunk(self, use: dict) -> dict:
        return {**super().usage_chunk(use), "object": "chat.completion.chunk"}
