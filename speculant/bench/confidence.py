"""How sure a bench ratio is: a paired bootstrap over the prompts.

Two methods of one cell ran the same prompts side by side (`--interleave`), so the noise that
moves a ratio is what differs between prompts: their texts (a copy-heavy prompt drafts well, a
chatty one does not) and the machine's speed while each ran. Resampling the prompts with
replacement and recomputing the ratio of the two methods' decode rates over each resample gives
the ratio's spread; its 2.5th and 97.5th percentiles are the 95% interval. Each prompt brings its
share of the decode-only steps (`Sequence.decode_only_tokens`, `decode_only_s`: the tokens it
committed in them and an equal share of their time), summed over the cell's repeats, so the
whole cell's tokens over its time is the cell's decode rate at any concurrency, and a resample's
is the same quantity over the prompts it drew.

Measured why it matters (AMD EPYC Zen 4, 2 threads, 2026-12-07): three engines with the same
settings, prompts alternating, 12 mt_bench prompts of plain decoding, read 155.2 / 158.1 / 155.9
and 159.5 / 160.3 / 165.9 tok/s in two runs: identical methods part by up to 4% on a dozen
prompts, as much as the differences the bench is asked to tell apart.
"""
from __future__ import annotations

import torch

LEVEL = 0.95
NUM_RESAMPLES = 4000
SEED = 0


def prompt_decode(seqs_per_repeat: list[list]) -> list[tuple[int, float]]:
    """Per prompt: (decode tokens, decode seconds) of its share of the decode-only steps,
    summed over repeats; each repeat lists the prompts' sequences in prompt order
    (`decode_only_tokens`, `decode_only_s`)."""
    num_prompts = min((len(seqs) for seqs in seqs_per_repeat), default=0)
    out = []
    for i in range(num_prompts):
        tokens = sum(seqs[i].decode_only_tokens for seqs in seqs_per_repeat)
        seconds = sum(seqs[i].decode_only_s for seqs in seqs_per_repeat)
        out.append((tokens, seconds))
    return out


def prompt_decode_repeats(seqs_per_repeat: list[list]) -> list[list[tuple[int, float]]]:
    """Per repeat, per prompt: (decode tokens, decode seconds) of its share of that repeat's
    decode-only steps (`prompt_decode` sums these over the repeats)."""
    num_prompts = min((len(seqs) for seqs in seqs_per_repeat), default=0)
    return [[(seqs[i].decode_only_tokens, seqs[i].decode_only_s) for i in range(num_prompts)]
            for seqs in seqs_per_repeat]


def paired_repeats_interval(other: list[list[tuple[int, float]]],
                            base: list[list[tuple[int, float]]], level: float = LEVEL,
                            num_resamples: int = NUM_RESAMPLES, seed: int = SEED
                            ) -> tuple[float, float] | None:
    """The `level` interval of the statistic the bench reports as a ratio of two methods run side
    by side in repeats (`report.paired_speedup`): the median over repeats k of other's decode
    rate in repeat k over base's, with the prompts resampled in pairs, the same draw in every
    repeat (a prompt is one text whatever the repeat). One repeat each: `paired_ratio_interval`
    over that repeat. Repeats that do not pair up (unequal counts, a method cut short): the
    interval of the ratio pooled over the repeats, as the summed `prompt_decode` gives it.
    (Pooled always, the interval could miss the reported median of the repeats' ratios: the
    tuned draft on qa at c=8 read 0.989 of untuned over three repeats with an interval of
    0.991-0.997, AMD EPYC Zen 4, 2026-12-08.)"""
    if not other or not base:
        return None
    if len(other) != len(base) or any(len(o) != len(b) for o, b in zip(other, base)) \
            or len({len(o) for o in other}) != 1:
        other, base = [_summed(other)], [_summed(base)]  # pooled over the repeats
        if len(other[0]) != len(base[0]):
            return None
    summed_o, summed_b = _summed(other), _summed(base)
    keep = [i for i, (o, b) in enumerate(zip(summed_o, summed_b))
            if o[0] > 0 and o[1] > 0 and b[0] > 0 and b[1] > 0]
    if len(keep) < 2:
        return None
    data = torch.tensor([[(*o[i], *b[i]) for i in keep] for o, b in zip(other, base)],
                        dtype=torch.float64)  # [K, P, 4]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(keep), (num_resamples, len(keep)), generator=gen)  # [R, P]
    sums = data[:, idx].sum(dim=2)  # [K, R, 4]
    ratios = (sums[..., 0] / sums[..., 1]) / (sums[..., 2] / sums[..., 3])  # [K, R]
    ratios = torch.where(torch.isfinite(ratios), ratios, torch.nan)
    stat = torch.nanquantile(ratios, 0.5, dim=0)  # [R] the median over repeats
    stat = stat[torch.isfinite(stat)]
    return _interval(stat, level) if stat.numel() else None


def _summed(repeats: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Each prompt's (tokens, seconds) summed over the repeats (`prompt_decode`)."""
    num_prompts = min(len(r) for r in repeats)
    return [(sum(r[i][0] for r in repeats), sum(r[i][1] for r in repeats))
            for i in range(num_prompts)]


def paired_ratio_interval(other: list[tuple[int, float]], base: list[tuple[int, float]],
                          level: float = LEVEL, num_resamples: int = NUM_RESAMPLES,
                          seed: int = SEED) -> tuple[float, float] | None:
    """The `level` interval of (other's decode rate) / (base's) over prompts resampled in pairs
    (prompt i of `other` ran beside prompt i of `base`); None when the two do not pair up or
    fewer than 2 prompts decoded in both (a prompt that did not decode in either is left out of
    both). Deterministic for a given seed. One repeat of `paired_repeats_interval`."""
    if len(other) != len(base):
        return None
    return paired_repeats_interval([other], [base], level, num_resamples, seed)


def ratio_interval(parts: list[tuple[float, float]], level: float = LEVEL,
                   num_resamples: int = NUM_RESAMPLES, seed: int = SEED
                   ) -> tuple[float, float] | None:
    """The `level` interval of sum(a) / sum(b) over the prompts' (a, b) resampled, e.g. one
    method's accepted tokens over its verification steps; None with fewer than 2 prompts that
    have b > 0."""
    rows = [p for p in parts if p[1] > 0]
    if len(rows) < 2:
        return None
    sums = _resampled_sums(rows, num_resamples, seed)  # [R, 2]
    return _interval(sums[:, 0] / sums[:, 1], level)


def _resampled_sums(rows: list[tuple[float, ...]], num_resamples: int, seed: int) -> torch.Tensor:
    """rows [P, k] -> their column sums over `num_resamples` draws of P rows with replacement
    [R, k]."""
    data = torch.tensor(rows, dtype=torch.float64)  # [P, k]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(rows), (num_resamples, len(rows)), generator=gen)  # [R, P]
    return data[idx].sum(dim=1)


def _interval(values: torch.Tensor, level: float) -> tuple[float, float]:
    tail = (1.0 - level) / 2
    lo, hi = torch.quantile(values, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return lo, hi
