"""Acceptance estimates and the expected-gain maths the chain uses to pick and trim drafts.

Let a_i be the probability that the target accepts draft position i given it accepted every
position before it. A draft of length k then yields E[accepted] = sum_{i<=k} prod_{j<=i} a_j
tokens, and verifying it costs k extra rows in the target forward, each worth `cost_per_token`
of a plain decode step (measured online by the engine). Position i is worth drafting while
its survival probability prod_{j<=i} a_j exceeds that cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Beta prior on a_i: optimistic enough that a new speculator gets tried, weak enough that a
# handful of verifications overrides it.
PRIOR_ACCEPT = 1.0
PRIOR_REJECT = 1.0
# Pseudo-count weight of the speculator-wide estimate inside a sequence's own estimate.
GLOBAL_WEIGHT = 4.0


def survival(cond_rates: list[float]) -> list[float]:
    """prod_{j<=i} a_j for each i."""
    out, s = [], 1.0
    for a in cond_rates:
        s *= a
        out.append(s)
    return out


def worth_drafting(surv: list[float], cost_per_token: float) -> int:
    """Longest prefix whose every position has survival above the per-token verify cost."""
    k = 0
    for s in surv:
        if s <= cost_per_token:
            break
        k += 1
    return k


def net_gain(surv: list[float], length: int, cost_per_token: float) -> float:
    return sum(surv[:length]) - cost_per_token * length


@dataclass(slots=True)
class AcceptanceCounts:
    """Per-position counts: `reached[i]` verified drafts with position i whose prefix was
    accepted, `accepted[i]` those where position i was accepted too."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, draft_len: int, num_accepted: int) -> None:
        grow = draft_len - len(self.reached)
        if grow > 0:
            self.reached.extend([0] * grow)
            self.accepted.extend([0] * grow)
        for i in range(min(draft_len, num_accepted + 1)):
            self.reached[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1

    def rate(self, i: int, prior: float, weight: float) -> float:
        """Posterior mean of a_i, shrunk towards `prior` with `weight` pseudo-counts."""
        reached = self.reached[i] if i < len(self.reached) else 0
        accepted = self.accepted[i] if i < len(self.accepted) else 0
        return (accepted + prior * weight) / (reached + weight)


def conditional_rates(global_counts: AcceptanceCounts, seq_counts: AcceptanceCounts | None,
                      length: int, token_probs: list[float] | None = None) -> list[float]:
    """a_i for i < length.

    Prior: the speculator-wide rate, averaged with the drafter's own confidence in the token
    (`token_probs`) where it reports one. Evidence: this sequence's own verifications, which
    override the prior after a few drafts, so a confident drafter that keeps being wrong on
    this text backs off, and one that keeps being right drafts long.
    """
    rates = []
    for i in range(length):
        prior = global_counts.rate(i, PRIOR_ACCEPT / (PRIOR_ACCEPT + PRIOR_REJECT),
                                   PRIOR_ACCEPT + PRIOR_REJECT)
        if token_probs is not None and i < len(token_probs):
            prior = 0.5 * (prior + token_probs[i])
        rates.append(seq_counts.rate(i, prior, GLOBAL_WEIGHT) if seq_counts is not None else prior)
    return rates
