"""Sampler: penalties and filters on hand-made logits, inverse-CDF sampling, seeds, rollback."""
import math

import pytest
import torch

from speculant.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    filter_probs,
    inverse_cdf,
    logits_to_probs,
    sample_from_probs,
)
from speculant.engine.sampling_params import SamplingParams

P = [0.5, 0.3, 0.15, 0.05]  # base distribution; its logits are log P


def normalised(weights):
    return [w / sum(weights) for w in weights]


PENALTY_CASES = [
    # (logits, history, penalty, expected)
    ([2.0, -2.0, 1.0, 0.0], [0, 1], 2.0, [1.0, -4.0, 1.0, 0.0]),  # divide > 0, multiply < 0
    ([2.0, -2.0, 1.0, 0.0], [0, 0, 1, 0], 2.0, [1.0, -4.0, 1.0, 0.0]),  # repeats count once (a set)
    ([2.0, -2.0, 1.0, 0.0], [0, 1, 3], 0.5, [4.0, -1.0, 1.0, 0.0]),  # < 1 rewards; 0 stays 0
    ([2.0, -2.0, 1.0, 0.0], [], 2.0, [2.0, -2.0, 1.0, 0.0]),  # empty history changes nothing
    ([2.0, -2.0, 1.0, 0.0], [0, 1], 1.0, [2.0, -2.0, 1.0, 0.0]),  # penalty 1 is off
]


@pytest.mark.parametrize("logits, history, penalty, expected", PENALTY_CASES)
def test_repetition_penalty(logits, history, penalty, expected):
    """HF semantics over the set of history tokens."""
    out = apply_repetition_penalty(torch.tensor([logits]), history, penalty)
    assert out[0].tolist() == expected


def test_repetition_penalty_row_i_sees_draft_prefix():
    """Row i is penalised for history + draft[:i], not for later draft tokens."""
    logits = torch.full((3, 4), 2.0)
    out = apply_repetition_penalty(logits, [0], 2.0, draft_ids=[1, 2])
    assert out.tolist() == [[1.0, 2.0, 2.0, 2.0], [1.0, 1.0, 2.0, 2.0], [1.0, 1.0, 1.0, 2.0]]


FILTER_CASES = [
    # (logits, params, expected probs)
    (P, dict(), P),  # temperature 1, no filters: softmax of log P is P
    (P, dict(temperature=2.0), normalised([math.sqrt(p) for p in P])),  # T flattens: p^(1/T)
    (P, dict(temperature=0.5), normalised([p * p for p in P])),  # T < 1 sharpens
    (P, dict(top_k=2), [0.625, 0.375, 0.0, 0.0]),  # two largest, renormalised
    (P, dict(top_k=3), normalised(P[:3]) + [0.0]),
    (P, dict(top_k=10), P),  # k >= V is off
    ([1.0, 2.0, 2.0, 0.0], dict(top_k=1), [0.0, 0.5, 0.5, 0.0]),  # ties at the k-th are kept
    (P, dict(top_p=0.45), [1.0, 0.0, 0.0, 0.0]),  # the top token alone reaches 0.45
    (P, dict(top_p=0.75), [0.625, 0.375, 0.0, 0.0]),  # 0.5 < 0.75 <= 0.8
    (P, dict(top_p=0.85), normalised(P[:3]) + [0.0]),  # 0.8 < 0.85 <= 0.95
    ([2.0, 2.0, 0.0, 0.0], dict(top_p=0.1), [0.5, 0.5, 0.0, 0.0]),  # ties with the last kept stay
    (P, dict(top_k=2, top_p=0.6), [1.0, 0.0, 0.0, 0.0]),  # top-p runs on the top-k renormalised
    (P, dict(min_p=0.25), normalised(P[:3]) + [0.0]),  # keep p >= 0.25 * 0.5
    (P, dict(min_p=0.35), [0.625, 0.375, 0.0, 0.0]),  # keep p >= 0.175
    (P, dict(min_p=0.5, temperature=2.0),  # min-p sees the tempered distribution
     normalised([math.sqrt(p) for p in P[:3]]) + [0.0]),
    (P, dict(temperature=0.0), [1.0, 0.0, 0.0, 0.0]),  # greedy: one-hot argmax
    ([1.0, 3.0, 3.0, 0.0], dict(temperature=0.0), [0.0, 1.0, 0.0, 0.0]),  # greedy ties: lowest id
]


@pytest.mark.parametrize("logits, params, expected", FILTER_CASES)
def test_logits_to_probs(logits, params, expected):
    """Each filter keeps the documented support with renormalised probabilities."""
    raw = torch.tensor([logits]).log() if logits is P else torch.tensor([logits])
    probs = logits_to_probs(raw, SamplingParams(**params))
    torch.testing.assert_close(probs[0], torch.tensor(expected), atol=1e-6, rtol=1e-5)


def test_filters_are_batched_per_row():
    """Rows are filtered independently (top-p cut differs per row)."""
    logits = torch.tensor([P, [0.1, 0.2, 0.3, 0.4]]).log()
    probs = logits_to_probs(logits, SamplingParams(top_p=0.75))
    expected = [[0.625, 0.375, 0.0, 0.0], [0.0] + normalised([0.2, 0.3, 0.4])]
    torch.testing.assert_close(probs, torch.tensor(expected))


def dense_reference(logits, params):
    """The filters applied one by one on the whole vocabulary, with a full sort for top-p."""
    logits = apply_temperature(logits, params.temperature)
    logits = apply_min_p(apply_top_p(apply_top_k(logits, params.top_k), params.top_p), params.min_p)
    return logits.softmax(-1)


def random_logits(n, vocab_size, scale, seed, tie_at=0, bf16=False):
    """Random logits; `tie_at` = k copies the k-th largest value into the (k+1)-th token of
    every row; bf16 rounding makes ties among the largest values common, as in real models."""
    logits = scale * torch.randn(n, vocab_size, generator=torch.Generator().manual_seed(seed))
    if bf16:
        logits = logits.bfloat16().float()
    if tie_at:
        values, ids = logits.topk(tie_at + 1, dim=-1)
        logits.scatter_(-1, ids[:, tie_at:], values[:, tie_at - 1:tie_at])
    return logits


COMPACT_CASES = [
    # (params, logits scale, tie at the k-th value, bf16 logits, path taken: compact or dense)
    (dict(top_k=20), 3.0, False, False, "compact"),  # top-k never touches the rest of the vocab
    (dict(top_k=20), 3.0, True, False, "compact"),  # a tie at the k-th: top-k keeps k + 1 tokens
    (dict(top_k=50, top_p=0.9, min_p=0.01, temperature=0.8), 3.0, False, False, "compact"),
    (dict(top_k=50, top_p=0.9), 3.0, True, False, "compact"),  # the tie is in top-p's normaliser
    (dict(top_k=40, top_p=0.95, temperature=0.7), 3.0, False, True, "compact"),  # bf16 ties
    (dict(top_p=0.9), 6.0, False, False, "compact"),  # peaked: nucleus within the candidates
    (dict(top_p=0.9), 0.1, False, False, "dense"),  # flat: nucleus wider than the candidates
    (dict(min_p=0.1), 3.0, False, False, "dense"),  # min-p alone does not bound the support
]


@pytest.mark.parametrize("params, scale, tie, bf16, path", COMPACT_CASES)
def test_compact_filtering_equals_dense_reference(params, scale, tie, bf16, path):
    """The fast path keeps the same support and probabilities as the filters applied densely."""
    params = SamplingParams(**params)
    logits = random_logits(6, 4000, scale, seed=0, tie_at=params.top_k if tie else 0, bf16=bf16)
    probs = filter_probs(logits, params)
    assert (probs.token_ids is not None) == (path == "compact")
    torch.testing.assert_close(probs.to_dense(4000), dense_reference(logits, params))


@pytest.mark.parametrize("params, bf16", [(dict(top_k=20), True), (dict(top_p=0.9), False)])
def test_compact_sampling_is_inverse_cdf_in_token_id_order(params, bf16):
    """Sampling the compact form picks the token the dense inverse CDF picks."""
    logits = random_logits(6, 4000, 6.0, seed=1, bf16=bf16)
    probs = filter_probs(logits, SamplingParams(**params))
    assert probs.token_ids is not None
    uniforms = torch.rand(50, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dense = probs.to_dense(4000)
    for u in uniforms:
        assert torch.equal(probs.sample(u), inverse_cdf(dense, u))


INVERSE_CDF_CASES = [
    # (u, expected token) for weights [1, 0, 2, 1]: cdf 0.25, 0.25, 0.75, 1 in token-id order
    (0.0, 0),  # u = 0 picks the lowest id with mass
    (0.2499, 0),
    (0.25, 2),  # token 1 has no mass and is skipped
    (0.7499, 2),
    (0.75, 3),
    (0.999999, 3),
]


@pytest.mark.parametrize("u, expected", INVERSE_CDF_CASES)
def test_sample_from_probs(u, expected):
    """Inverse CDF in token-id order, normalised or not."""
    assert sample_from_probs(torch.tensor([0.25, 0.0, 0.5, 0.25]), u) == expected
    assert sample_from_probs(torch.tensor([1.0, 0.0, 2.0, 1.0]), u) == expected


def test_inverse_cdf_on_a_uniform_grid_matches_probs():
    """N evenly spaced uniforms hit each token N * p times, up to one."""
    probs = torch.distributions.Dirichlet(torch.ones(7)).sample(torch.Size([3]))
    n = 1000
    grid = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    token_ids = inverse_cdf(probs[:, None, :].expand(3, n, 7), grid.expand(3, n))
    counts = torch.stack([row.bincount(minlength=7) for row in token_ids])
    assert (counts - n * probs).abs().max() <= 1.0 + 1e-6


def test_greedy_sample_uses_penalised_argmax_and_no_randomness():
    """Greedy = argmax after the penalty; the random stream is untouched."""
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=4.0, seed=1), 3)
    state = sampler.get_state()
    assert sampler.sample(torch.tensor([2.0, 1.0, 0.0]), history=[]) == 0
    assert sampler.sample(torch.tensor([2.0, 1.0, 0.0]), history=[0]) == 1  # 2/4 < 1
    assert torch.equal(sampler.get_state(), state)


def sample_many(sampler, n, vocab_size=50):
    logits = torch.zeros(vocab_size)
    return [sampler.sample(logits, history=[]) for _ in range(n)]


def test_same_seed_same_tokens_different_seed_different_tokens():
    """The seed alone determines the tokens."""
    first = sample_many(Sampler(SamplingParams(seed=7), 50), 40)
    assert sample_many(Sampler(SamplingParams(seed=7), 50), 40) == first
    assert sample_many(Sampler(SamplingParams(seed=8), 50), 40) != first


def test_no_seed_means_fresh_entropy():
    """Two unseeded samplers start from different states."""
    a, b = Sampler(SamplingParams(), 50), Sampler(SamplingParams(), 50)
    assert not torch.equal(a.get_state(), b.get_state())


def test_clone_and_restore_reproduce_the_continuation():
    """A clone, or a restored snapshot, continues exactly like the original."""
    sampler = Sampler(SamplingParams(seed=3, top_k=20), 50)
    sample_many(sampler, 5)
    twin, snapshot = sampler.clone(), sampler.get_state()
    continuation = sample_many(sampler, 10)
    assert sample_many(twin, 10) == continuation
    sampler.set_state(snapshot)
    assert sample_many(sampler, 10) == continuation


@pytest.mark.parametrize("params", [
    dict(),  # plain temperature sampling
    dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2),  # all filters
])
def test_one_uniform_per_sampled_token(params):
    """n samples leave the generator where n uniform draws would."""
    sampler = Sampler(SamplingParams(seed=11, **params), 50)
    sample_many(sampler, 13)
    reference = torch.Generator().manual_seed(11)
    torch.rand(13, dtype=torch.float64, generator=reference)
    assert torch.equal(sampler.get_state(), reference.get_state())


def test_batched_uniforms_equal_sequential_uniforms():
    """Drawing n uniforms at once equals n single draws (verify_match relies on it)."""
    one, many = Sampler(SamplingParams(seed=5), 2), Sampler(SamplingParams(seed=5), 2)
    sequential = torch.cat([one.draw_uniforms(1) for _ in range(300)])
    assert torch.equal(many.draw_uniforms(300), sequential)
    assert torch.equal(one.get_state(), many.get_state())


def test_sample_is_inverse_cdf_of_processed_probs_at_the_next_uniform():
    """sample() = inverse CDF of processed_probs with the stream's next uniform."""
    params = SamplingParams(seed=2, temperature=0.8, top_p=0.9, repetition_penalty=1.3)
    sampler, logits, history = Sampler(params, 20), torch.randn(20), [3, 4, 3]
    twin = sampler.clone()
    expected = int(inverse_cdf(twin.processed_probs(logits[None], history)[0],
                               twin.draw_uniforms(1)[0]))
    assert sampler.sample(logits, history) == expected


def test_processed_probs_row_i_conditions_on_draft_prefix():
    """Batched positions equal one position at a time with the draft appended to history."""
    sampler = Sampler(SamplingParams(repetition_penalty=1.5, top_k=6, top_p=0.9), 16)
    logits, history, draft = torch.randn(4, 16), [1, 2], [5, 1, 7]
    batched = sampler.processed_probs(logits, history, draft)
    for i in range(4):
        row = sampler.processed_probs(logits[i:i + 1], history + draft[:i])
        torch.testing.assert_close(batched[i], row[0])


@pytest.mark.parametrize("shape, draft", [
    ((2, 9), []),  # logits wider than the vocabulary
    ((2, 8), [1, 2]),  # a draft token without a position to score it
])
def test_misuse_raises(shape, draft):
    """Wrong shapes fail loudly."""
    with pytest.raises(ValueError):
        Sampler(SamplingParams(), 8).processed_probs(torch.zeros(shape), [], draft)
