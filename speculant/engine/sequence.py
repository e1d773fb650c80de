"""One request's sequence: its tokens, progress through the KV cache, and its statistics."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from speculant.engine.sampling_params import SamplingParams
from speculant.speculators.counters import AcceptanceCounters


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; no KV yet
    RUNNING = "running"  # admitted: prefilling (num_computed < num_prompt) or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class SeqSpecStats(AcceptanceCounters):
    """Speculation counters of one request, in total and per speculator that won a draft."""

    by_type: dict[str, AcceptanceCounters] = field(default_factory=dict)

    def record(self, source: str, draft_len: int, num_accepted: int) -> None:
        """A draft made by speculator `source` was verified (the step itself is recorded
        apart: steps without a draft count too)."""
        self.record_draft(draft_len, num_accepted)
        self.by_type.setdefault(source, AcceptanceCounters()).record_draft(draft_len, num_accepted)


@dataclass(slots=True, eq=False)
class Sequence:
    """Invariant while decoding: `num_computed == len(token_ids) - 1` — the last sampled token
    is not yet in the KV cache; it is the first input of the next step.

    Compared by identity (eq=False): a request is one object, and the scheduler's membership
    tests (`seq in self.running`) compared every field of the other sequences they passed,
    ~1 us each (8,000 calls in a 460-step c=8 run)."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: object  # speculant.engine.sampler.Sampler
    detokenizer: object = None  # speculant.engine.detokenizer.Detokenizer: the output text
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is committed in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    spec: SeqSpecStats = field(default_factory=SeqSpecStats)
    spec_types: tuple[str, ...] = ()  # speculators this request may use (empty = none)
    kv_budget: int = 0  # KV positions reserved for this step (the scheduler sets it)
    num_preemptions: int = 0  # times its KV was dropped to make room (recomputed later)
    stop_text_len: int | None = None  # where a stop string cut the text, if one did
    synthetic: bool = False  # tokens accepted by synthetic rates: output is not valid text
    # Target features returned with the output: layer -> committed rows, in position order.
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, list] = field(default_factory=dict)
    # Timings (time.perf_counter): added, first scheduled, first token out, finished.
    arrival_time: float = field(default_factory=time.perf_counter)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_time_s: float = 0.0  # wall time of the steps that ran this sequence's prompt chunks
    # ... and of the steps that decoded it (other sequences' prompt chunks in them included):
    # the engine's own time, which a wall clock from first token to finish is not when several
    # engines take turns on the machine (`speculant bench --interleave`)
    decode_step_time_s: float = 0.0
    # its share of the decode-only steps (no prompt chunk in them): the tokens it committed in
    # them and an equal share of their time, so that a run's decode rate (their tokens over
    # their time) is the sum of its sequences' tokens over the sum of their shares
    decode_only_tokens: int = 0
    decode_only_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids):]

    @property
    def num_prefill(self) -> int:
        """Tokens to put in the KV cache before decoding: the prompt, or after a preemption
        everything but the last sampled token (the next step's input)."""
        return max(self.num_prompt, len(self.token_ids) - 1)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prefill

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
