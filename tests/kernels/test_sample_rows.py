"""Native sampling (kernels/sample.py): the law of engine/sampler.py's PyTorch pipeline.

The native draw keeps the same tokens and gives each the same interval of [0, 1) in token-id
order as `filter_probs(...).to_dense` + inverse CDF; only a uniform within rounding of an
interval's edge may land on the neighbour, so the checks below aim at interval midpoints or
skip uniforms that close to an edge."""
import pytest
import torch

from speculant.engine.sampler import Sampler, filter_probs
from speculant.engine.sampling_params import SamplingParams
from speculant.kernels import native_available
from speculant.kernels.sample import native_sampling_fits, sample_rows, sample_rows_with_prob

pytestmark = pytest.mark.skipif(not native_available(), reason="native kernels unavailable here")

FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.6),
    dict(temperature=1.7),
    dict(temperature=0.8, top_k=1),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.0, top_k=40),
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=1.3, top_p=0.5),
    dict(temperature=0.7, top_k=40, top_p=0.9),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.5, top_p=0.8, min_p=0.1),
    dict(temperature=2.0, top_p=0.99),
]


def _name(filters: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in filters.items())


def _rows(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits shaped like a language model's: a few likely tokens over a long tail."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=g) * 2.5
    heads = torch.randint(0, vocab, (num_rows, 12), generator=g)
    logits.scatter_add_(1, heads, torch.rand(num_rows, 12, generator=g) * 12)
    return logits


def _cdf(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The PyTorch pipeline's normalised CDF over token ids, in float64 [V]."""
    probs = filter_probs(logits_row[None], params).to_dense(logits_row.shape[0])[0].double()
    cdf = probs.cumsum(0)
    return cdf / cdf[-1]


def _native(logits: torch.Tensor, uniforms: torch.Tensor, p: SamplingParams) -> list[int]:
    return sample_rows(logits, uniforms, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                       min_p=p.min_p).tolist()


@pytest.mark.parametrize("vocab", [1, 5, 8, 63, 64, 65, 1000, 49152])
@pytest.mark.parametrize("filters", FILTERS, ids=_name)
def test_every_kept_token_owns_its_interval(vocab, filters):
    params = SamplingParams(**filters)
    logits = _rows(2, vocab, seed=vocab)
    for row in logits:
        cdf = _cdf(row, params)
        probs = torch.diff(cdf, prepend=cdf.new_zeros(1))
        # every token the filters keep with a visible share, at the middle of its interval
        kept = (probs > 1e-5).nonzero()[:, 0]
        mids = (cdf[kept] - probs[kept] / 2).clamp(0, 1 - 1e-12)
        got, prob = sample_rows_with_prob(
            row[None].expand(len(kept), -1).contiguous(), mids, temperature=params.temperature,
            top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
        assert got.tolist() == kept.tolist()
        # and each its probability under the filtered distribution
        torch.testing.assert_close(prob.double(), probs[kept], rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("filters", FILTERS, ids=_name)
def test_random_uniforms_give_the_pytorch_pipelines_tokens(filters):
    params = SamplingParams(**filters)
    logits = _rows(6, 49152, seed=7)
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        uniforms = torch.rand(6, dtype=torch.float64, generator=g)
        got = _native(logits, uniforms, params)
        expected = filter_probs(logits, params).sample(uniforms).tolist()
        for r in range(6):
            if got[r] != expected[r]:  # only a uniform at an interval's edge may differ
                cdf = _cdf(logits[r], params)
                assert (cdf - uniforms[r]).abs().min() < 1e-6, (r, got[r], expected[r])


def test_ties_at_the_top_k_and_top_p_boundaries_are_kept():
    logits = torch.full((1, 100), -5.0)
    logits[0, [10, 20, 30]] = 4.0  # three tied for 2nd..4th place
    logits[0, 50] = 6.0
    # top-k 2: the k-th value is 4.0, so all three 4.0s stay (4 tokens)
    p = SamplingParams(temperature=1.0, top_k=2)
    cdf = _cdf(logits[0], p)
    probs = torch.diff(cdf, prepend=cdf.new_zeros(1))
    assert (probs > 0).nonzero()[:, 0].tolist() == [10, 20, 30, 50]
    mids = cdf[[10, 20, 30, 50]] - probs[[10, 20, 30, 50]] / 2
    assert _native(logits.expand(4, -1).contiguous(), mids, p) == [10, 20, 30, 50]
    # top-p reached inside the tie (token 50 holds 0.71 of the mass, the first 4.0 brings the
    # run to 0.81): the whole tie is kept, nothing below it
    p = SamplingParams(temperature=1.0, top_p=0.75)
    cdf = _cdf(logits[0], p)
    kept = (torch.diff(cdf, prepend=cdf.new_zeros(1)) > 0).nonzero()[:, 0]
    assert kept.tolist() == [10, 20, 30, 50]
    seen = set(_native(logits.expand(512, -1).contiguous(),
                       torch.linspace(0, 1 - 1e-9, 512, dtype=torch.float64), p))
    assert seen == {10, 20, 30, 50}


def test_nan_infinities_and_short_rows():
    logits = torch.zeros(5, 20)
    logits[0, [4, 9]] = float("nan")  # a NaN row gives its first NaN, as greedy does
    logits[1, [6, 12]] = float("inf")  # +inf: its first +inf
    logits[2] = float("-inf")  # nothing above -inf: 0
    logits[3, :] = float("-inf")
    logits[3, 17] = 0.0  # a single finite entry, in the scalar tail
    logits[4, 19] = 50.0  # certain: the last entry
    p = SamplingParams(temperature=0.9, top_p=0.9)
    u = torch.full((5,), 0.999, dtype=torch.float64)
    assert _native(logits, u, p) == [4, 6, 0, 17, 19]
    assert _native(torch.tensor([[3.0]]), torch.tensor([0.5], dtype=torch.float64), p) == [0]


def test_a_row_is_drawn_alike_alone_or_in_a_batch():
    logits = _rows(9, 13312, seed=3)
    uniforms = torch.rand(9, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for filters in FILTERS:
        p = SamplingParams(**filters)
        batch = _native(logits, uniforms, p)
        alone = [_native(logits[r:r + 1].clone(), uniforms[r:r + 1], p)[0] for r in range(9)]
        assert batch == alone


def test_sampler_draws_natively_and_alike_on_either_path():
    """A seeded request's stream of tokens: the native and PyTorch paths agree (these logits
    put no uniform at an interval's edge)."""
    logits = _rows(40, 49152, seed=13)
    for filters in (dict(temperature=0.8, top_p=0.95, seed=1), dict(temperature=1.0, seed=2),
                    dict(temperature=0.7, top_k=40, seed=3)):
        params = SamplingParams(**filters)
        native = Sampler(params, 49152)
        fallback = Sampler(params, 49152, native=False)
        assert native_sampling_fits(logits, native.native)
        assert ([native.sample(row, [1, 2]) for row in logits]
                == [fallback.sample(row, [1, 2]) for row in logits])
        assert native.get_state().equal(fallback.get_state())  # one uniform per token on both


def test_bad_inputs_are_refused_by_name():
    logits = torch.randn(2, 50)
    u = torch.rand(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="contiguous float32 CPU logits"):
        sample_rows(logits.half(), u, temperature=1.0)
    with pytest.raises(ValueError, match="contiguous float32 CPU logits"):
        sample_rows(logits.t(), u, temperature=1.0)
    with pytest.raises(RuntimeError, match="uniforms must be a float64 CPU tensor"):
        sample_rows(logits, torch.rand(3, dtype=torch.float64), temperature=1.0)
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        sample_rows(logits, u, temperature=0.0)
    with pytest.raises(RuntimeError, match="top_p must be in"):
        sample_rows(logits, u, temperature=1.0, top_p=0.0)
    with pytest.raises(RuntimeError, match="top_k must be >= 0"):
        sample_rows(logits, u, temperature=1.0, top_k=-1)
    with pytest.raises(RuntimeError, match="min_p must be in"):
        sample_rows(logits, u, temperature=1.0, min_p=1.5)
