"""What a finished (or streaming) request reports: text, tokens, timings, speculation stats."""
from __future__ import annotations

from dataclasses import dataclass, field

from speculant.sequence import Sequence


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    time_s: float  # arrival to finish
    prefill_time_s: float
    spec: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.time_s if self.time_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode_s = self.time_s - self.prefill_time_s
        return (self.num_generated - 1) / decode_s if decode_s > 0 and self.num_generated > 1 else 0.0


def spec_summary(seq: Sequence) -> dict:
    """The `spec` object of `--json` output and HTTP `timings` (vLLM's metric names)."""
    s = seq.spec
    return {
        "type_used": ",".join(seq.spec_types) if seq.spec_types else "none",
        "num_drafts": s.num_drafts,
        "num_draft_tokens": s.num_draft_tokens,
        "num_accepted_tokens": s.num_accepted_tokens,
        "num_steps": s.num_steps,
        "mean_accepted_length": round(s.mean_accepted_length, 4),
        "acceptance_rate": round(s.num_accepted_tokens / s.num_draft_tokens, 4)
        if s.num_draft_tokens else 0.0,
        "accepted_per_pos": list(s.accepted_per_pos),
        "synthetic": seq.synthetic,  # true: accepted by --spec-synth-rates, output invalid
        "per_speculator": {
            name: {"num_drafts": n, "num_accepted_tokens": s.accepted_by_type.get(name, 0)}
            for name, n in s.drafts_by_type.items()
        },
    }


def make_output(seq: Sequence, text: str) -> RequestOutput:
    end = seq.finish_time if seq.finish_time is not None else seq.arrival_time
    return RequestOutput(
        request_id=seq.request_id,
        text=text,
        token_ids=list(seq.output_ids),
        prompt_token_ids=list(seq.prompt_ids),
        finish_reason=seq.finish_reason,
        time_s=max(0.0, end - seq.arrival_time),
        prefill_time_s=seq.prefill_time_s,
        spec=spec_summary(seq),
        error=seq.error,
    )
