"""Speculation counters: one type, one definition of every derived quantity.

The engine (per request), the chain (per speculator, and per speculator within a request), the
replay simulator, the CLI, the bench and the server's `/metrics` all count with
`AcceptanceCounters` and read mean accepted length and acceptance rate from it, nowhere else.

Names follow vLLM's spec-decode metrics:
- `num_steps`: verification steps, i.e. target forwards that produced tokens for a decoding
  sequence (with or without a draft). Per speculator: its verified drafts.
- `num_drafts`: drafts the target verified (proposals that lost in the chain are not counted
  here; `SpeculatorStats.num_proposals` counts those).
- `num_draft_tokens`, `num_accepted_tokens`: tokens in verified drafts, and those accepted.
- `accepted_per_pos[i]`: verified drafts whose token i was accepted.
- `drafted_per_pos[i]`: verified drafts that had a token i.
- `reached_per_pos[i]`: verified drafts that had a token i and whose tokens before i were all
  accepted (the denominator of the conditional acceptance rate a_i).
- mean accepted length = 1 + accepted / steps: tokens produced per verification step
  (1.0 for plain decoding, and when nothing was verified yet).
- acceptance rate = accepted / draft tokens (0.0 when nothing was drafted).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def _add_per_pos(total: list[int], more: list[int]) -> None:
    if len(more) > len(total):
        total.extend([0] * (len(more) - len(total)))
    for i, n in enumerate(more):
        total[i] += n


def _bump(per_pos: list[int], count: int, length: int) -> None:
    """per_pos[i] += 1 for i < count; the list covers at least `length` positions (a report
    shows a zero for positions drafted but never accepted)."""
    if length > len(per_pos):
        per_pos.extend([0] * (length - len(per_pos)))
    for i in range(count):
        per_pos[i] += 1


@dataclass(slots=True)
class AcceptanceCounters:
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    reached_per_pos: list[int] = field(default_factory=list)

    def record_step(self) -> None:
        self.num_steps += 1

    def record_draft(self, draft_len: int, num_accepted: int) -> None:
        """One draft of `draft_len` tokens verified, its first `num_accepted` accepted."""
        if not 0 <= num_accepted <= draft_len:
            raise ValueError(f"{num_accepted} accepted of a {draft_len}-token draft")
        self.num_drafts += 1
        self.num_draft_tokens += draft_len
        self.num_accepted_tokens += num_accepted
        _bump(self.accepted_per_pos, num_accepted, draft_len)
        _bump(self.drafted_per_pos, draft_len, draft_len)
        _bump(self.reached_per_pos, min(draft_len, num_accepted + 1), draft_len)

    def record_position(self, pos: int, accepted: bool) -> None:
        """Position `pos` of a draft whose earlier positions were all accepted was judged on its
        own (the chain scores a trimmed draft's next token against the sampled one)."""
        _bump(self.reached_per_pos, 0, pos + 1)  # cover the position
        _bump(self.accepted_per_pos, 0, pos + 1)
        self.reached_per_pos[pos] += 1
        self.accepted_per_pos[pos] += int(accepted)

    def add(self, other: AcceptanceCounters) -> None:
        """Accumulate `other`'s counts into these (requests into a run, runs into a total)."""
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        _add_per_pos(self.accepted_per_pos, other.accepted_per_pos)
        _add_per_pos(self.drafted_per_pos, other.drafted_per_pos)
        _add_per_pos(self.reached_per_pos, other.reached_per_pos)

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_steps if self.num_steps else 1.0

    @property
    def mean_accepted_length_per_draft(self) -> float:
        """1 + accepted / drafts: tokens per step that verified a draft, as vLLM's "mean
        acceptance length" and EAGLE's tau count them. `mean_accepted_length` counts every step,
        those the chain priced out of drafting (one token each) too: the two differ by how often
        drafting was judged worth it, this one is the drafter's accuracy alone."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def conditional_rate(self, i: int, prior: float, weight: float) -> float:
        """Posterior mean of a_i (position i accepted given all before it were), shrunk
        towards `prior` with `weight` pseudo-counts."""
        reached = self.reached_per_pos[i] if i < len(self.reached_per_pos) else 0
        accepted = self.accepted_per_pos[i] if i < len(self.accepted_per_pos) else 0
        return (accepted + prior * weight) / (reached + weight)

    def summary(self, digits: int = 4) -> dict:
        """The counters as reported in JSON (CLI `--json`, bench, HTTP timings, replay)."""
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, digits),
            "mean_accepted_length_per_draft": round(self.mean_accepted_length_per_draft, digits),
            "acceptance_rate": round(self.acceptance_rate, digits),
            "accepted_per_pos": list(self.accepted_per_pos),
        }


def total(counters) -> AcceptanceCounters:
    """The sum of several counters."""
    out = AcceptanceCounters()
    for c in counters:
        out.add(c)
    return out
