"""Turning target logits into tokens: pure filter functions and the per-request `Sampler`.

Pipeline (Hugging Face order): repetition penalty -> temperature -> top-k -> top-p -> min-p
-> softmax -> inverse-CDF sampling with one uniform. Temperature 0 is greedy: the argmax of the
penalised logits, lowest token id on ties, consuming no randomness.

Conventions:
- Filters are thresholds on value: a filter keeps every token whose logit is at least that of
  the last token it must keep, so tokens tied at a boundary are all kept (top-k may keep more
  than k tokens). This makes every filter deterministic, independent of sort stability.
- Inverse-CDF sampling walks the vocabulary in token-id order (not sorted by probability):
  token i is chosen for u in [cdf[i-1], cdf[i]) of the normalised cumulative distribution, so
  u = 0 picks the lowest id with non-zero probability and zero-probability tokens never come.
- Every non-greedy sampled token consumes exactly one float64 uniform from the request's CPU
  generator. Drawing n uniforms at once yields the same values, and leaves the generator in the
  same state, as n single draws; `verify.verify_match` relies on this.

Cost: `Sampler.sample_ids` (plain decoding and sample-and-match verification) draws natively
on contiguous float32 CPU logits (`kernels/sample.py`: the same filters and law, two or three
passes over a row: 45-75 us for a 49,152-token row on an AMD EPYC, where the PyTorch pipeline
below took 110-390 us, and ~4 ms when a top-p nucleus was wider than its candidates). The
PyTorch pipeline (other devices, dense distributions for rejection sampling): with top-k, or
top-p whose nucleus lies within the `TOP_P_CANDIDATES` most likely tokens, filtering, softmax
and sampling run on those few candidates only (`TokenProbs` compact form); the vocabulary is
touched by one top-k selection (a second when ties straddle the k-th value; for top-p without
top-k, one logsumexp). Other settings work densely, batched over positions; only a top-p
nucleus wider than the candidates sorts the whole vocabulary.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculant.engine.sampling_params import SamplingParams
from speculant.kernels.argmax import row_argmax
from speculant.kernels.sample import native_sampling_fits, sample_rows

TOP_P_CANDIDATES = 256  # top-p without top-k first looks for its nucleus among this many tokens


def apply_repetition_penalty(
    logits: torch.Tensor,  # [n, vocab_size]
    token_ids: Sequence[int] | torch.Tensor,  # [num_history]
    penalty: float,
    draft_ids: Sequence[int] | torch.Tensor = (),  # [num_draft], num_draft < n
) -> torch.Tensor:  # [n, vocab_size]
    """HF repetition penalty: divide positive logits and multiply negative ones by `penalty`
    for every distinct token in the history. Row i also penalises `draft_ids[:i]`, the draft
    tokens that position i is conditioned on. Returns a new tensor."""
    if penalty == 1.0:
        return logits
    seen = set(token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)
    draft = draft_ids.tolist() if isinstance(draft_ids, torch.Tensor) else list(draft_ids)
    device = logits.device
    out = logits.clone()
    # 1) history tokens, in every row
    history_ids = torch.tensor(sorted(seen), dtype=torch.long, device=device)
    out[:, history_ids] = _penalise(logits[:, history_ids], penalty)
    # 2) draft[j] in rows i > j, unless the history already penalised it (never twice)
    if draft:
        rows, cols = torch.tril_indices(logits.shape[0], len(draft), offset=-1, device=device)
        is_new = torch.tensor([t not in seen for t in draft], device=device)[cols]
        rows, cols = rows[is_new], torch.tensor(draft, device=device)[cols[is_new]]
        out[rows, cols] = _penalise(logits[rows, cols], penalty)  # repeats write equal values
    return out


def _penalise(values: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(values > 0, values / penalty, values * penalty)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Scale logits [..., V] by 1/temperature (temperature > 0)."""
    return logits if temperature == 1.0 else logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k largest logits per row (plus ties with the k-th); 0 or k >= V = off."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth_largest = logits.topk(top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, -math.inf)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches `top_p`
    (plus ties with its least likely member). Sorts the whole row."""
    if top_p >= 1.0:
        return logits
    sorted_logits = logits.sort(dim=-1, descending=True).values
    cum_probs = (sorted_logits - logits.logsumexp(dim=-1, keepdim=True)).exp().cumsum(dim=-1)
    cut = _nucleus_cut(sorted_logits, cum_probs, top_p)
    return logits.masked_fill(logits < cut, -math.inf)


def _nucleus_cut(sorted_logits: torch.Tensor, cum_probs: torch.Tensor,
                 top_p: float) -> torch.Tensor:
    """Smallest logit [..., 1] of the nucleus: the first sorted token whose inclusive
    cumulative probability reaches top_p (the last sorted one if none does)."""
    last = (cum_probs < top_p).sum(dim=-1, keepdim=True).clamp(max=sorted_logits.shape[-1] - 1)
    return sorted_logits.gather(-1, last)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep tokens with probability >= min_p * (max probability), computed in logit space."""
    if min_p <= 0.0:
        return logits
    threshold = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
    return logits.masked_fill(logits < threshold, -math.inf)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Batched inverse-CDF sampling in column order: probs [..., m] (non-negative weights
    with a positive sum), uniforms [...] in [0, 1) -> column indices [...] (long)."""
    cdf = probs.double().cumsum(dim=-1)  # fp64 so that u * total < total for every u < 1
    targets = uniforms.to(cdf) * cdf[..., -1]
    columns = torch.searchsorted(cdf, targets.unsqueeze(-1), right=True).squeeze(-1)
    return columns.clamp_(max=probs.shape[-1] - 1)


def sample_from_probs(probs: torch.Tensor, u: float) -> int:
    """One token from probs [V] with the single uniform `u` in [0, 1), in token-id order."""
    return int(inverse_cdf(probs, torch.tensor(u, dtype=torch.float64, device=probs.device)))


@dataclass(slots=True)
class TokenProbs:
    """Filtered distributions at n positions, compact when the filters allow.

    Dense: `probs` is [n, vocab_size] and `token_ids` None. Compact: `probs` is [n, m] over
    the m candidates `token_ids` [n, m] (zeros where filtered); no other token has mass.
    """

    probs: torch.Tensor  # [n, m]
    token_ids: torch.Tensor | None = None  # [n, m]; None = column i is token i

    def to_dense(self, vocab_size: int) -> torch.Tensor:  # [n, vocab_size]
        if self.token_ids is None:
            return self.probs
        dense = self.probs.new_zeros(self.probs.shape[0], vocab_size)
        return dense.scatter_(-1, self.token_ids, self.probs)

    def sample(self, uniforms: torch.Tensor) -> torch.Tensor:
        """Token ids [n] by inverse CDF in token-id order, one uniform [n] per position."""
        if self.token_ids is None:
            return inverse_cdf(self.probs, uniforms)
        ids_in_order, order = self.token_ids.sort(dim=-1)  # candidates in token-id order
        columns = inverse_cdf(self.probs.gather(-1, order), uniforms)
        return ids_in_order.gather(-1, columns.unsqueeze(-1)).squeeze(-1)


def filter_probs(logits: torch.Tensor, params: SamplingParams) -> TokenProbs:
    """Temperature, top-k, top-p, min-p and softmax of logits [n, V], compact when possible.

    The repetition penalty needs the history and is applied before, by the caller.
    Temperature 0 gives the greedy one-hot distribution."""
    logits = logits.float()
    if params.is_greedy:
        argmax = logits.argmax(dim=-1, keepdim=True)
        return TokenProbs(torch.ones(argmax.shape, device=logits.device), argmax)
    compact = _compact_probs(logits, params)
    if compact is not None:
        return compact
    # dense: top-k is off here (it always takes the compact path)
    logits = apply_temperature(logits, params.temperature)
    logits = apply_top_p(logits, params.top_p)
    logits = apply_min_p(logits, params.min_p)
    return TokenProbs(logits.softmax(dim=-1))


def _compact_probs(logits: torch.Tensor, params: SamplingParams) -> TokenProbs | None:
    """The filters of `filter_probs` on the top candidates only; None when top-p without
    top-k may keep more than `TOP_P_CANDIDATES` tokens, or when no filter bounds the support."""
    vocab_size = logits.shape[-1]
    if 0 < params.top_k < vocab_size:
        values, token_ids = _top_k_candidates(logits, params.top_k)
        values = apply_temperature(values, params.temperature)
        log_total = values.logsumexp(dim=-1, keepdim=True)  # top-p sees the top-k set
        outside = None  # every token outside the candidates is already filtered
    elif params.top_p < 1.0 and TOP_P_CANDIDATES < vocab_size:
        # one extra candidate: the best token outside must fall below the nucleus
        values, token_ids = logits.topk(TOP_P_CANDIDATES + 1, dim=-1)
        values = apply_temperature(values, params.temperature)
        values, outside, token_ids = values[:, :-1], values[:, -1:], token_ids[:, :-1]
        tempered = apply_temperature(logits, params.temperature)
        log_total = tempered.logsumexp(dim=-1, keepdim=True)  # top-p sees the whole vocabulary
    else:
        return None
    if params.top_p < 1.0:
        cum_probs = (values - log_total).exp().cumsum(dim=-1)
        cut = _nucleus_cut(values, cum_probs, params.top_p)
        if outside is not None and bool(
                ((cum_probs[:, -1:] < params.top_p) | (outside >= cut)).any()):
            return None  # the nucleus needs more than the candidates, or ties past them
        values = values.masked_fill(values < cut, -math.inf)
    values = apply_min_p(values, params.min_p)  # the candidates hold every row's maximum
    return TokenProbs(values.softmax(dim=-1), token_ids)


def _top_k_candidates(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, m] (descending) and ids [n, m] of every row's top-k set, ties with the k-th
    value included (m >= k), with -inf where a candidate is below its own row's k-th value."""
    values, token_ids = logits.topk(top_k + 1, dim=-1)
    kth_largest = values[:, top_k - 1:top_k]
    if bool((values[:, top_k:] >= kth_largest).any()):  # ties: widen to the largest tied set
        num_candidates = int((logits >= kth_largest).sum(dim=-1).max())
        values, token_ids = logits.topk(num_candidates, dim=-1)
    else:
        values, token_ids = values[:, :top_k], token_ids[:, :top_k]
    return values.masked_fill(values < kth_largest, -math.inf), token_ids


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Dense filtered distributions [n, V] (fp32) of logits [n, V]; see `filter_probs`."""
    return filter_probs(logits, params).to_dense(logits.shape[-1])


class Sampler:
    """Sampling state of one request: its parameters and its random stream.

    The stream is a CPU `torch.Generator` seeded from `params.seed` (fresh entropy if None), so
    a seed gives the same tokens on any device. Each non-greedy token consumes exactly one
    uniform; greedy consumes none. `get_state` / `set_state` / `clone` snapshot the stream to
    roll back a rejected speculation (llama.cpp's `common_sampler_clone`).
    """

    def __init__(self, params: SamplingParams, vocab_size: int, *,
                 native: bool | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.params = params
        self.vocab_size = vocab_size
        self.native = native  # None: the native draw where it fits; False: PyTorch only
        self.generator = torch.Generator(device="cpu")
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)

    def penalised_logits(self, logits: torch.Tensor, history: Sequence[int],
                         draft: Sequence[int] = ()) -> torch.Tensor:
        """Logits [n, V] (fp32) after the repetition penalty; row i conditioned on
        history + draft[:i]."""
        if logits.dim() != 2 or logits.shape[-1] != self.vocab_size:
            raise ValueError(f"expected logits [n, {self.vocab_size}], got {tuple(logits.shape)}")
        if len(draft) >= logits.shape[0]:
            raise ValueError(f"{len(draft)} draft tokens need at least {len(draft) + 1} "
                             f"positions, got {logits.shape[0]}")
        return apply_repetition_penalty(logits.float(), history, self.params.repetition_penalty,
                                        draft)

    def token_probs(self, logits: torch.Tensor, history: Sequence[int],
                    draft: Sequence[int] = ()) -> TokenProbs:
        """Distributions at n consecutive positions, row i conditioned on history + draft[:i]
        (one-hot at the argmax when greedy), compact when the filters allow."""
        return filter_probs(self.penalised_logits(logits, history, draft), self.params)

    def processed_probs(self, logits: torch.Tensor, history: Sequence[int],
                        draft: Sequence[int] = ()) -> torch.Tensor:
        """`token_probs` as dense distributions [n, V] (for rejection sampling)."""
        return self.token_probs(logits, history, draft).to_dense(self.vocab_size)

    def greedy_ids(self, logits: torch.Tensor, history: Sequence[int],
                   draft: Sequence[int] = ()) -> torch.Tensor:
        """Argmax [n] of the penalised logits (lowest id on ties), row i after draft[:i]."""
        return self.penalised_logits(logits, history, draft).argmax(dim=-1)

    def draw_uniforms(self, n: int) -> torch.Tensor:
        """The next n uniforms [n] (fp64, CPU) of this request's stream."""
        return torch.rand(n, dtype=torch.float64, generator=self.generator)

    def peek_uniforms(self, n: int) -> torch.Tensor:
        """The next n uniforms [n] without consuming them (coupled drafts read them)."""
        state = self.get_state()
        uniforms = self.draw_uniforms(n)
        self.set_state(state)
        return uniforms

    def sample_ids(self, logits: torch.Tensor, history: Sequence[int], uniforms: torch.Tensor,
                   draft: Sequence[int] = ()) -> list[int]:
        """Tokens at n consecutive positions, row i conditioned on history + draft[:i] and drawn
        with uniforms[i] (fp64 [n]; greedy reads none): natively where the logits fit, else
        by `token_probs(...).sample`. Consumes no randomness itself."""
        logits = self.penalised_logits(logits, history, draft)
        p = self.params
        if p.is_greedy:
            return row_argmax(logits)[0].tolist()
        if native_sampling_fits(logits, self.native):
            return sample_rows(logits, uniforms, temperature=p.temperature, top_k=p.top_k,
                               top_p=p.top_p, min_p=p.min_p).tolist()
        return filter_probs(logits, p).sample(uniforms.to(logits.device)).tolist()

    def sample(self, logits: torch.Tensor, history: Sequence[int]) -> int:
        """One token from logits [V] at the position after `history`."""
        if self.params.is_greedy:
            return int(self.greedy_ids(logits.unsqueeze(0), history)[0])
        return self.sample_ids(logits.unsqueeze(0), history, self.draw_uniforms(1))[0]

    def get_state(self) -> torch.Tensor:
        """Opaque snapshot of the random stream (the only mutable state)."""
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    def clone(self) -> Sampler:
        """An independent sampler that continues exactly as this one would."""
        twin = Sampler(self.params, self.vocab_size, native=self.native)
        twin.set_state(self.get_state())
        return twin
