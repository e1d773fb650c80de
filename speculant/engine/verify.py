"""Lossless verification of drafts by the target model.

Terms (as in vLLM's rejection sampler):
- *draft tokens* x_0..x_{k-1}: what a speculator proposed after the sequence's last token.
- *target position* i (0..k): the target's distribution for the token after history + x_{<i};
  one target forward over [last token, x_0..x_{k-1}] scores all k+1 positions.
- *accepted tokens*: the longest prefix of the draft the verifier keeps.
- *recovered token*: the target's own token at the first rejected position (the correction).
- *bonus token*: the target's token at position k when every draft token was accepted.
Every verification emits the accepted tokens plus exactly one recovered or bonus token, so a
step always advances by at least one token, and the emitted tokens follow the target's
distribution exactly whatever the drafter proposed.

Verifiers:
- greedy: the target's argmax at each position; accept while it equals the draft.
- match (sample-and-match, as llama.cpp): sample each position with the request's own sampler
  and accept while the sample equals the draft. It consumes one uniform per emitted token, so
  it reproduces plain decoding with the same seed token for token, for any sampler settings.
- rejection (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
  Sampling"): accept x_i with probability min(1, p_i(x_i) / q_i(x_i)) and recover from the
  normalised residual max(0, p_i - q_i). It accepts more often than match when the draft
  distribution q is close to p, but equals plain decoding only in distribution, not per seed.

The `accept_*` functions are the tensor maths (no host sync); the `verify_*` functions serve
one sequence and return a `VerifyResult`. Greedy verification compares host lists: the engine
takes the argmax of every row of a step in one op and one host sync, after which comparing a
few draft tokens per sequence in Python costs less than building tensors for a batched compare.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speculant.engine.sampler import Sampler, inverse_cdf


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Outcome for one sequence: accepted draft tokens followed by one target token."""

    num_accepted: int
    token_ids: list[int]  # draft[:num_accepted] + [recovered or bonus token]

    def __post_init__(self) -> None:
        if len(self.token_ids) != self.num_accepted + 1:
            raise ValueError(
                f"token_ids must hold num_accepted + 1 = {self.num_accepted + 1} tokens, "
                f"got {len(self.token_ids)}")


def _as_list(token_ids: Sequence[int] | torch.Tensor) -> list[int]:
    return token_ids.tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)


def _check_positions(num_positions: int, num_draft: int) -> None:
    if num_positions != num_draft + 1:
        raise ValueError(f"{num_draft} draft tokens need {num_draft + 1} target positions, "
                         f"got {num_positions}")


def verify_greedy(target_ids: Sequence[int] | torch.Tensor,  # [k+1] argmax per position
                  draft_ids: Sequence[int] | torch.Tensor,  # [k]
                  ) -> VerifyResult:
    """Accept draft tokens while they equal the target's argmax."""
    target, draft = _as_list(target_ids), _as_list(draft_ids)
    _check_positions(len(target), len(draft))
    num_accepted = 0
    while num_accepted < len(draft) and draft[num_accepted] == target[num_accepted]:
        num_accepted += 1
    return VerifyResult(num_accepted, target[:num_accepted + 1])


def accept_match(
    samples: torch.Tensor,  # [batch, k+1] the target sampler's token at every position
    draft_ids: torch.Tensor,  # [batch, k]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample-and-match: accept the draft up to the first position where the target's sample
    differs. Returns num_accepted [batch] and next_token_ids [batch]: the first mismatching
    sample (recovered) or the sample at position k (bonus)."""
    matched = samples[:, :-1] == draft_ids
    num_accepted = matched.long().cumprod(dim=-1).sum(dim=-1)
    return num_accepted, samples.gather(-1, num_accepted.unsqueeze(-1)).squeeze(-1)


def verify_match(sampler: Sampler,
                 logits: torch.Tensor,  # [k+1, vocab_size] raw target logits
                 history: Sequence[int],  # tokens before position 0 (for penalties)
                 draft_ids: Sequence[int] | torch.Tensor,  # [k]
                 ) -> VerifyResult:
    """Sample-and-match with the request's sampler; greedy requests use `verify_greedy`.

    Consumes exactly num_accepted + 1 uniforms, so the sampler's stream stays where plain
    decoding of the same tokens would have left it."""
    draft = _as_list(draft_ids)
    _check_positions(logits.shape[0], len(draft))
    if sampler.params.is_greedy:
        return verify_greedy(sampler.greedy_ids(logits, history, draft), draft)
    if not draft:  # plain decoding: one uniform, nothing to rewind
        return VerifyResult(0, sampler.sample_ids(logits, history, sampler.draw_uniforms(1)))
    # 1) sample every position with the uniforms plain decoding would use, without committing
    state = sampler.get_state()
    samples = sampler.sample_ids(logits, history, sampler.draw_uniforms(len(draft) + 1), draft)
    num_accepted = 0
    while num_accepted < len(draft) and samples[num_accepted] == draft[num_accepted]:
        num_accepted += 1
    # 2) one uniform per emitted token: when the draft was rejected, the uniforms of the tail
    # after the recovered token are drawn again by the next step
    if num_accepted < len(draft):
        sampler.set_state(state)
        sampler.draw_uniforms(num_accepted + 1)
    return VerifyResult(num_accepted, draft[:num_accepted] + [samples[num_accepted]])


def accept_rejection(
    p_tgt: torch.Tensor,  # [batch, k+1, vocab_size] target distributions
    q_dft: torch.Tensor | None,  # [batch, k, vocab_size] draft distributions; None = one-hot
    draft_ids: torch.Tensor,  # [batch, k]
    uniforms: torch.Tensor,  # [batch, k+1]: k acceptance tests, then the final sample
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan rejection sampling. Returns num_accepted [batch] and next_token_ids [batch].

    One-hot drafts (q None) accept x with probability p(x) and recover from p with x removed.
    Where the residual is all zero (only reachable through rounding, or a draft token its own
    drafter gave probability 0) the recovered token is sampled from p instead."""
    k = draft_ids.shape[1]
    # fp64 so that a uniform just below 1 never rounds up to 1 and rejects p = q
    p_draft = p_tgt[:, :k].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()  # [batch, k]
    q_draft = (torch.ones_like(p_draft) if q_dft is None
               else q_dft.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double())
    # accept with probability min(1, p/q): u < p/q, multiplied out so that q = 0 is safe
    accepted = uniforms[:, :k].to(p_draft) * q_draft < p_draft
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    final_dist = _final_distribution(p_tgt, q_dft, draft_ids, num_accepted)
    return num_accepted, inverse_cdf(final_dist, uniforms[:, k])


def _final_distribution(p_tgt: torch.Tensor, q_dft: torch.Tensor | None,
                        draft_ids: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Where each sequence's last token comes from [batch, vocab_size]: the residual at the
    rejected position, or p_k for the bonus (and p where the residual is all zero)."""
    (batch, k), vocab_size = draft_ids.shape, p_tgt.shape[-1]
    rows = num_accepted.view(batch, 1, 1).expand(batch, 1, vocab_size)
    p_row = p_tgt.gather(1, rows).squeeze(1)  # [batch, vocab_size]
    if k == 0:
        return p_row
    rejected_pos = num_accepted.clamp(max=k - 1)  # meaningless for the bonus, masked below
    if q_dft is None:
        residual = p_row.scatter(-1, draft_ids.gather(-1, rejected_pos.unsqueeze(-1)), 0.0)
    else:
        q_row = q_dft.gather(1, rejected_pos.view(batch, 1, 1).expand(batch, 1, vocab_size))
        residual = (p_row - q_row.squeeze(1)).clamp(min=0.0)
    use_p = (num_accepted == k) | (residual.sum(dim=-1) <= 0)
    return torch.where(use_p.unsqueeze(-1), p_row, residual)


def verify_rejection(p_tgt: torch.Tensor,  # [k+1, vocab_size] processed target distributions
                     q_dft: torch.Tensor | None,  # [k, vocab_size]; None = deterministic draft
                     draft_ids: Sequence[int] | torch.Tensor,  # [k]
                     generator: torch.Generator,
                     ) -> VerifyResult:
    """Rejection sampling for one sequence; always consumes k + 1 uniforms of `generator`."""
    draft = _as_list(draft_ids)
    _check_positions(p_tgt.shape[0], len(draft))
    if q_dft is not None and q_dft.shape != (len(draft), p_tgt.shape[-1]):
        raise ValueError(f"q_dft must be [{len(draft)}, {p_tgt.shape[-1]}], "
                         f"got {tuple(q_dft.shape)}")
    uniforms = torch.rand(len(draft) + 1, dtype=torch.float64, generator=generator,
                          device=generator.device).to(p_tgt.device)
    draft_tensor = torch.tensor([draft], dtype=torch.long, device=p_tgt.device)
    num_accepted, next_id = accept_rejection(
        p_tgt[None], None if q_dft is None else q_dft[None], draft_tensor, uniforms[None])
    num_accepted, next_id = torch.cat([num_accepted, next_id]).tolist()
    return VerifyResult(num_accepted, draft[:num_accepted] + [next_id])
