"""What a finished (or streaming) request reports: text, tokens, timings, speculation stats."""
from __future__ import annotations

from dataclasses import dataclass, field

from speculant.engine.sequence import Sequence
from speculant.speculators.counters import AcceptanceCounters


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    time_s: float  # arrival to finish (includes waiting for a free slot)
    prefill_time_s: float  # steps that ran the prompt's chunks
    queue_time_s: float = 0.0  # arrival to first scheduled
    decode_time_s: float = 0.0  # first token to finish
    spec: dict = field(default_factory=dict)  # spec_summary(seq)
    counters: AcceptanceCounters | None = None  # the request's speculation counters
    # layer -> [tokens processed, hidden]: target features, when requested (LLM.generate)
    hidden_states: dict | None = None
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
        """Tokens after the first per second after the first: the request's own decode speed,
        independent of how long it waited or how long its prompt took."""
        return decode_rate(self.num_generated, self.decode_time_s)


def decode_rate(num_generated: int, decode_time_s: float) -> float:
    """Decode tokens/s: the first token belongs to the prefill, the rest to decode time."""
    return (num_generated - 1) / decode_time_s if decode_time_s > 0 and num_generated > 1 else 0.0


def spec_summary(seq: Sequence) -> dict:
    """The `spec` object of `--json` output and HTTP `timings` (counters.py defines each field)."""
    s = seq.spec
    return {
        "type_used": ",".join(seq.spec_types) if seq.spec_types else "none",
        **s.summary(),
        "synthetic": seq.synthetic,  # true: accepted by --spec-synth-rates, output invalid
        "per_speculator": {
            name: {"num_drafts": c.num_drafts, "num_accepted_tokens": c.num_accepted_tokens}
            for name, c in s.by_type.items()
        },
    }


def make_output(seq: Sequence, text: str) -> RequestOutput:
    end = seq.finish_time if seq.finish_time is not None else seq.arrival_time
    scheduled = seq.scheduled_time if seq.scheduled_time is not None else end
    first = seq.first_token_time if seq.first_token_time is not None else end
    return RequestOutput(
        request_id=seq.request_id,
        text=text,
        token_ids=list(seq.output_ids),
        prompt_token_ids=list(seq.prompt_ids),
        finish_reason=seq.finish_reason,
        time_s=max(0.0, end - seq.arrival_time),
        prefill_time_s=seq.prefill_time_s,
        queue_time_s=max(0.0, scheduled - seq.arrival_time),
        decode_time_s=max(0.0, end - first),
        spec=spec_summary(seq),
        counters=seq.spec,
        error=seq.error,
    )
