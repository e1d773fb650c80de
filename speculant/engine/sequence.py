"""One request's sequence: its tokens, progress through the KV cache, and its statistics."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from speculant.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; no KV yet
    RUNNING = "running"  # admitted: prefilling (num_computed < num_prompt) or decoding
    FINISHED = "finished"


@dataclass(slots=True)
class SeqSpecStats:
    """Speculation counters of one request (vLLM's metric names)."""

    num_steps: int = 0  # target forwards that produced tokens for this sequence (decode steps)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafts_by_type: dict[str, int] = field(default_factory=dict)
    accepted_by_type: dict[str, int] = field(default_factory=dict)

    def record(self, source: str, draft_len: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < draft_len:
            self.accepted_per_pos.extend([0] * (draft_len - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        self.drafts_by_type[source] = self.drafts_by_type.get(source, 0) + 1
        self.accepted_by_type[source] = self.accepted_by_type.get(source, 0) + num_accepted

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verification step: 1 + accepted / steps."""
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0


@dataclass(slots=True)
class Sequence:
    """Invariant while decoding: `num_computed == len(token_ids) - 1` — the last sampled token
    is not yet in the KV cache; it is the first input of the next step."""

    seq_id: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sampler: object  # speculant.sampler.Sampler
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is committed in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    spec: SeqSpecStats = field(default_factory=SeqSpecStats)
    spec_types: tuple[str, ...] = ()  # speculators this request may use (empty = none)
    kv_budget: int = 0  # KV tokens promised to this sequence at admission
    stop_text_len: int | None = None  # where a stop string cut the text, if one did
    synthetic: bool = False  # tokens accepted by synthetic rates: output is not valid text
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_time_s: float = 0.0

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
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
