"""Verifiers: table-driven outcomes, equivalence with plain decoding, and statistical checks
that sample-and-match and rejection sampling emit exactly the target distribution."""
import math
import random

import pytest
import torch

from speculant.engine.sampler import Sampler, inverse_cdf
from speculant.engine.sampling_params import SamplingParams
from speculant.engine.verify import (
    VerifyResult,
    accept_match,
    accept_rejection,
    verify_greedy,
    verify_match,
    verify_rejection,
)

GREEDY_CASES = [
    # (target_ids, draft_ids, num_accepted, token_ids)
    ([5, 6, 7, 8], [5, 6, 7], 3, [5, 6, 7, 8]),  # all accepted, 8 is the bonus
    ([5, 6, 7, 8], [4, 6, 7], 0, [5]),  # first rejected, 5 is the recovered token
    ([5, 6, 7, 8], [5, 6, 9], 2, [5, 6, 7]),  # partial
    ([5, 6, 7, 8], [5, 9, 7], 1, [5, 6]),  # a match after a mismatch does not count
    ([5], [], 0, [5]),  # no draft: the target's token alone
]


def test_verify_result_length_is_checked():
    """token_ids must be the accepted tokens plus one."""
    with pytest.raises(ValueError):
        VerifyResult(2, [1, 2])


@pytest.mark.parametrize("target_ids, draft_ids, num_accepted, token_ids", GREEDY_CASES)
def test_verify_greedy(target_ids, draft_ids, num_accepted, token_ids):
    """Accept while the draft equals the target argmax."""
    assert verify_greedy(target_ids, draft_ids) == VerifyResult(num_accepted, token_ids)


def test_mismatched_shapes_raise():
    """k draft tokens need exactly k + 1 target positions and k draft distributions."""
    with pytest.raises(ValueError):
        verify_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError):
        verify_match(Sampler(SamplingParams(), 4), torch.zeros(2, 4), [], [1, 2])
    with pytest.raises(ValueError):
        verify_rejection(torch.full((3, 4), 0.25), torch.full((1, 4), 0.25), [1, 2],
                         torch.Generator())


def forced_logits(token_ids, vocab_size=10):
    """Logits [len, V] whose only finite entry per row is the given token: any sampler
    without greedy decoding must sample exactly these tokens."""
    logits = torch.full((len(token_ids), vocab_size), -math.inf)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 0.0
    return logits


@pytest.mark.parametrize("target_ids, draft_ids, num_accepted, token_ids", GREEDY_CASES)
def test_verify_match_forced_samples(target_ids, draft_ids, num_accepted, token_ids):
    """Sample-and-match on forced samples; it consumes num_accepted + 1 uniforms."""
    sampler = Sampler(SamplingParams(seed=4, top_p=0.9), 10)
    result = verify_match(sampler, forced_logits(target_ids), [], draft_ids)
    assert result == VerifyResult(num_accepted, token_ids)
    reference = Sampler(SamplingParams(seed=4), 10)
    reference.draw_uniforms(num_accepted + 1)
    assert torch.equal(sampler.get_state(), reference.get_state())


def test_verify_match_greedy_conditions_on_draft_prefix():
    """Greedy match penalises position 1 for draft token 0, changing its argmax."""
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0, seed=0), 3)
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.9, 0.0]])
    state = sampler.get_state()
    assert verify_match(sampler, logits, [], [0]) == VerifyResult(1, [0, 1])
    assert torch.equal(sampler.get_state(), state)  # greedy consumes no randomness


class ToyModel:
    """Fixed logits per (position, previous token): a stand-in for the target model."""

    def __init__(self, vocab_size=12, num_positions=7, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.table = 2.0 * torch.randn(num_positions, vocab_size, vocab_size, generator=gen)

    def logits(self, context):  # [V] for the token after `context`
        return self.table[len(context) % self.table.shape[0], context[-1]]


@pytest.mark.parametrize("params", [
    dict(seed=1),  # plain temperature 1
    dict(seed=2, temperature=0.7, top_k=6, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
    dict(seed=3, temperature=0.0, repetition_penalty=1.5),  # greedy
])
def test_verify_match_reproduces_plain_decoding(params):
    """Speculative decoding with sample-and-match emits the plain tokens, seed for seed."""
    model, prompt, num_tokens = ToyModel(), [1, 2, 3], 40
    plain_sampler = Sampler(SamplingParams(**params), 12)
    plain = list(prompt)
    for _ in range(num_tokens):
        plain.append(plain_sampler.sample(model.logits(plain), plain))
    sampler, seq, outcomes = Sampler(SamplingParams(**params), 12), list(prompt), set()
    rng = random.Random(0)
    while len(seq) < len(plain):
        # draft: the true continuation, 30% of tokens corrupted, of random length
        k = min(rng.randint(0, 5), len(plain) - len(seq) - 1)
        draft = [t if rng.random() < 0.7 else rng.randrange(12) for t in plain[len(seq):][:k]]
        logits = torch.stack([model.logits(seq + draft[:i]) for i in range(k + 1)])
        result = verify_match(sampler, logits, seq, draft)
        seq += result.token_ids
        outcomes.add("accepted" if result.num_accepted > 0 else "none")
        outcomes.add("rejected" if result.num_accepted < k else "bonus")
    assert seq == plain
    assert outcomes == {"accepted", "none", "rejected", "bonus"}  # every path was exercised
    assert torch.equal(sampler.get_state(), plain_sampler.get_state())


REJECTION_CASES = [
    # (target one-hot ids, draft_ids, use_q, num_accepted, token_ids)
    ([1, 2, 3], [1, 2], False, 2, [1, 2, 3]),  # one-hot draft, p(x) = 1: accepted, bonus 3
    ([1, 2, 3], [0, 2], False, 0, [1]),  # p(x) = 0: rejected, recovered from p
    ([1, 2, 3], [1, 0], False, 1, [1, 2]),  # partial
    ([1, 2, 3], [1, 2], True, 2, [1, 2, 3]),  # uniform q: p/q = V >= 1, accepted
    ([1, 2, 3], [1, 0], True, 1, [1, 2]),  # residual max(0, p - q) is p's one token
    ([4], [], True, 0, [4]),  # no draft: the bonus alone
]


@pytest.mark.parametrize("target_ids, draft_ids, use_q, num_accepted, token_ids", REJECTION_CASES)
def test_verify_rejection_table(target_ids, draft_ids, use_q, num_accepted, token_ids):
    """Rejection sampling on one-hot targets; it always consumes k + 1 uniforms."""
    p_tgt = forced_logits(target_ids, 5).softmax(-1)
    q_dft = torch.full((len(draft_ids), 5), 0.2) if use_q else None
    generator = torch.Generator().manual_seed(9)
    result = verify_rejection(p_tgt, q_dft, draft_ids, generator)
    assert result == VerifyResult(num_accepted, token_ids)
    reference = torch.Generator().manual_seed(9)
    torch.rand(len(draft_ids) + 1, dtype=torch.float64, generator=reference)
    assert torch.equal(generator.get_state(), reference.get_state())


DEGENERATE_CASES = [
    # (p at position 0, q at position 0 or None, draft id, acceptance uniform)
    ([0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], 2, 0.5),  # p(x) = q(x) = 0: residual p - q = 0
    ([1.0 - 2**-20, 0.0, 0.0, 0.0], None, 0, 0.9999999),  # rounding rejects x; p without x = 0
]


@pytest.mark.parametrize("p_row, q_row, draft_id, u_accept", DEGENERATE_CASES)
def test_rejection_with_all_zero_residual_samples_from_p(p_row, q_row, draft_id, u_accept):
    """An all-zero residual falls back to p (final uniform 0.3 picks p's first token 0)."""
    p_tgt = torch.tensor([[p_row, [0.25] * 4]])
    q_dft = None if q_row is None else torch.tensor([[q_row]])
    uniforms = torch.tensor([[u_accept, 0.3]], dtype=torch.float64)
    num_accepted, next_ids = accept_rejection(p_tgt, q_dft, torch.tensor([[draft_id]]), uniforms)
    assert (num_accepted.item(), next_ids.item()) == (0, 0)


# Statistical checks on a toy model with V = 5: the target gives P0 for the first token, P1[x]
# for the token after x, uniform after that; the drafter samples from Q0, Q1 (q != p, and q
# proposes token 4, which p never emits) or is deterministic (one-hot drafts). Whatever the
# drafter does, the first two emitted tokens must follow J[x, y] = P0[x] * P1[x, y].
V = 5


def toy_distributions(seed):
    gen = torch.Generator().manual_seed(seed)
    return (1.5 * torch.randn(V, generator=gen)).softmax(-1), \
        (1.5 * torch.randn(V, V, generator=gen)).softmax(-1)


P0, P1 = toy_distributions(seed=0)
P0[4], P1[:, 4] = 0.0, 0.0
P0, P1 = P0 / P0.sum(), P1 / P1.sum(-1, keepdim=True)
Q0, Q1 = toy_distributions(seed=1)
TARGET_JOINT = P0[:, None] * P1  # [V, V]


def next_dist(context, first, given_first):  # context [n, L] -> [n, V]
    if context.shape[1] == 0:
        return first.expand(context.shape[0], V)
    if context.shape[1] == 1:
        return given_first[context[:, 0]]
    return torch.full((context.shape[0], V), 1.0 / V)


def propose(seen, q_row, one_hot, gen):
    """Next draft token [n, 1]: sampled from q, or deterministically previous + 1 (0 first)."""
    if not one_hot:
        return torch.multinomial(q_row, 1, generator=gen)
    if seen.shape[1] == 0:
        return torch.zeros(seen.shape[0], 1, dtype=torch.long)
    return (seen[:, -1:] + 1) % V


def verify_round(method, context, k, gen):
    """Draft k tokens after each context [n, L] and verify them in one batched call."""
    one_hot = method == "rejection_one_hot"
    drafts, q_rows = context.new_empty(context.shape[0], 0), []
    for _ in range(k):
        seen = torch.cat([context, drafts], dim=1)
        q_rows.append(next_dist(seen, Q0, Q1))
        drafts = torch.cat([drafts, propose(seen, q_rows[-1], one_hot, gen)], dim=1)
    p_tgt = torch.stack([next_dist(torch.cat([context, drafts[:, :i]], 1), P0, P1)
                         for i in range(k + 1)], dim=1)  # [n, k+1, V]
    uniforms = torch.rand(context.shape[0], k + 1, dtype=torch.float64, generator=gen)
    if method == "match":
        return drafts, *accept_match(inverse_cdf(p_tgt, uniforms), drafts)
    q_dft = None if one_hot else torch.stack(q_rows, dim=1)  # [n, k, V]
    return drafts, *accept_rejection(p_tgt, q_dft, drafts, uniforms)


def first_two_tokens(method, n, seed):
    """Joint frequencies [V, V] of the first two tokens emitted by n simulated sequences."""
    gen = torch.Generator().manual_seed(seed)
    no_context = torch.empty(n, 0, dtype=torch.long)
    drafts, num_accepted, next_ids = verify_round(method, no_context, 2, gen)
    first = torch.where(num_accepted >= 1, drafts[:, 0], next_ids)
    second = torch.where(num_accepted >= 2, drafts[:, 1], next_ids)
    # sequences whose first round emitted one token verify a second round after it
    drafts2, num_accepted2, next_ids2 = verify_round(method, first.unsqueeze(1), 1, gen)
    second = torch.where(num_accepted >= 1, second,
                         torch.where(num_accepted2 >= 1, drafts2[:, 0], next_ids2))
    return torch.bincount(first * V + second, minlength=V * V).reshape(V, V).double() / n


def tv_bound(n, cells=V * V, delta=1e-9):
    """TV distance an exact sampler exceeds with probability < delta: from the L1 deviation
    inequality of Weissman et al. (2003), P(TV >= t) <= 2^cells * exp(-2 n t^2)."""
    return math.sqrt((cells * math.log(2) + math.log(1 / delta)) / (2 * n))


def total_variation(freqs, probs):
    return 0.5 * (freqs - probs.double()).abs().sum().item()


def test_toy_drafter_is_far_from_the_target():
    """Power check: emitting the drafts unverified would fail the bound by a wide margin."""
    assert total_variation((Q0[:, None] * Q1).double(), TARGET_JOINT) > 10 * tv_bound(50_000)


@pytest.mark.parametrize("method", ["match", "rejection", "rejection_one_hot"])
def test_verifier_preserves_target_distribution(method):
    """Joint law of the first two emitted tokens equals the target's; TV shrinks with n."""
    tv_small = total_variation(first_two_tokens(method, 2_000, seed=10), TARGET_JOINT)
    tv_large = total_variation(first_two_tokens(method, 50_000, seed=11), TARGET_JOINT)
    assert tv_small < tv_bound(2_000)
    assert tv_large < tv_bound(50_000)
    assert tv_large < tv_small
