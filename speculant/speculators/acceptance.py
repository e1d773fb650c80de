"""Acceptance estimates and the expected-gain maths the chain uses to pick and trim drafts.

Let a_i be the probability that the target accepts draft position i given it accepted every
position before it. A draft of length k then yields E[accepted] = sum_{i<=k} prod_{j<=i} a_j
tokens, and verifying it costs k extra rows in the target forward, each worth `cost_per_token`
of a plain decode step (measured online by the engine). Position i is worth drafting while
its survival probability prod_{j<=i} a_j exceeds that cost.
"""
from __future__ import annotations

from speculant.speculators.counters import AcceptanceCounters

# Beta prior on a_i: optimistic enough that a new speculator gets tried, weak enough that a
# handful of verifications overrides it.
PRIOR_ACCEPT = 1.0
PRIOR_REJECT = 1.0
# Pseudo-count weight of the speculator-wide estimate inside a sequence's own estimate.
GLOBAL_WEIGHT = 4.0
# Pseudo-count weight of a coarser speculator-wide level inside a finer one.
LEVEL_WEIGHT = 4.0


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


def conditional_rate(global_levels: list[AcceptanceCounters], seq_counts: AcceptanceCounters | None,
                     i: int, token_probs: list[float] | None = None) -> float:
    """a_i.

    Prior: the speculator-wide evidence, `global_levels` from coarse to fine (each level shrunk
    towards the one before it, the first towards the Beta prior), averaged with the drafter's
    own confidence in the token (`token_probs`) where it reports one. Evidence: this
    sequence's own record, which overrides the prior after a few drafts, so a confident drafter
    that keeps being wrong on this text backs off, and one that keeps being right drafts long.
    """
    prior, weight = PRIOR_ACCEPT / (PRIOR_ACCEPT + PRIOR_REJECT), PRIOR_ACCEPT + PRIOR_REJECT
    for counts in global_levels:
        prior, weight = counts.conditional_rate(i, prior, weight), LEVEL_WEIGHT
    if token_probs is not None and i < len(token_probs):
        prior = 0.5 * (prior + token_probs[i])
    return seq_counts.conditional_rate(i, prior, GLOBAL_WEIGHT) if seq_counts is not None else prior


def conditional_rates(global_levels: list[AcceptanceCounters], seq_counts: AcceptanceCounters | None,
                      length: int, token_probs: list[float] | None = None) -> list[float]:
    """a_i for i < length (`conditional_rate`)."""
    return [conditional_rate(global_levels, seq_counts, i, token_probs) for i in range(length)]


def survival_above(global_levels: list[AcceptanceCounters], seq_counts: AcceptanceCounters | None,
                   length: int, floor: float, token_probs: list[float] | None = None) -> list[float]:
    """survival(conditional_rates(...)) cut after its first value at or below `floor`: what
    `worth_drafting` and `net_gain` read at that cost, without the rates of positions that can
    never be worth verifying (a 16-token n-gram copy priced at every position of every
    sequence in every round was most of the chain's Python time at concurrency 8)."""
    return survival_above_rates(
        (conditional_rate(global_levels, seq_counts, i, token_probs) for i in range(length)), floor)


def survival_above_rates(cond_rates, floor: float) -> list[float]:
    """survival(cond_rates) cut after its first value at or below `floor` (`cond_rates` may be
    a lazy iterable: nothing after the cut is computed)."""
    out, s = [], 1.0
    for a in cond_rates:
        s *= a
        out.append(s)
        if s <= floor:
            break
    return out


def observed_acceptance(draft: list[int], truth: list[int]) -> tuple[int, int]:
    """What verifying `draft` would have shown, judged by the tokens the target committed after
    the same point (`truth`): (positions known, positions accepted). Positions past the end of
    `truth` are unknown; at temperature > 0 a match with the target's sampled token is what
    rejection sampling accepts for a one-hot draft."""
    known = min(len(draft), len(truth))
    accepted = 0
    while accepted < known and draft[accepted] == truth[accepted]:
        accepted += 1
    return known, accepted
