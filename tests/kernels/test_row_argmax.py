"""Greedy picks over logits rows (kernels/argmax.py): torch.argmax's answer on both paths."""
import pytest
import torch

from speculant.kernels import native_available, row_argmax


@pytest.fixture(params=["native", "fallback"])
def native(request) -> bool:
    if request.param == "native" and not native_available():
        pytest.skip("native kernels unavailable here")
    return request.param == "native"


@pytest.mark.parametrize("vocab", [1, 7, 8, 15, 16, 17, 63, 64, 65, 96, 100, 13312, 49152])
@pytest.mark.parametrize("rows", [1, 3, 20])
def test_index_is_torch_argmax_and_prob_its_softmax(vocab, rows, native):
    torch.manual_seed(vocab * 31 + rows)
    logits = torch.randn(rows, vocab) * 4
    index, prob = row_argmax(logits, with_prob=True, native=native)
    assert index.dtype == torch.int64 and torch.equal(index, logits.argmax(dim=-1))
    # against float64: a float32 softmax over 49,152 terms is off by up to ~1.2e-5 (torch's own,
    # the fallback, on an AVX2-only Zen 1: its sum order follows the CPU's vector width)
    expected = torch.softmax(logits.double(), dim=-1).gather(-1, index[:, None])[:, 0]
    torch.testing.assert_close(prob.double(), expected, rtol=5e-5, atol=0.0)
    assert row_argmax(logits, native=native)[1] is None


def test_ties_nan_and_infinities_follow_torch(native):
    logits = torch.zeros(5, 100)
    logits[0, [37, 80]] = 5.0  # a tie: the first index
    logits[1, [50, 60]] = float("nan")  # NaN wins, the first one
    logits[1, 90] = float("inf")
    logits[2] = float("-inf")  # nothing above -inf: index 0
    logits[3, [3, 30, 99]] = float("inf")  # the first +inf
    logits[4, 99] = 1.0  # the maximum in the scalar tail after the 8-lane part
    index, _ = row_argmax(logits, native=native)
    assert index.tolist() == logits.argmax(dim=-1).tolist() == [37, 50, 0, 3, 99]


@pytest.mark.parametrize("vocab", [64, 97, 1000, 49152])
def test_the_first_of_many_tied_maxima_wins(vocab, native):
    """Rows of a few distinct values, so that the maximum recurs in every vector lane and
    chain: the first one is torch.argmax's answer; and a maximum placed first in each of the
    four 8-lane chains of a 32-element step (native), or in the tail, is found there."""
    torch.manual_seed(vocab)
    logits = torch.randint(0, 3, (16, vocab)).float()
    assert torch.equal(row_argmax(logits, native=native)[0], logits.argmax(dim=-1))
    for pos in (0, 8, 16, 24, 40, vocab - 1):
        row = torch.zeros(1, vocab)
        row[0, pos:] = 1.0  # the maximum from `pos` on: the first is `pos`
        assert row_argmax(row, native=native)[0].item() == pos


def test_a_row_is_picked_alike_alone_or_in_a_batch():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    torch.manual_seed(3)
    batch = torch.randn(9, 13312)
    index, prob = row_argmax(batch, with_prob=True, native=True)
    for r in range(batch.shape[0]):
        i, p = row_argmax(batch[r:r + 1].clone(), with_prob=True, native=True)
        assert i.item() == index[r].item()
        assert p.view(torch.int32).item() == prob[r:r + 1].view(torch.int32).item()


def test_other_dtypes_and_layouts_take_the_pytorch_path():
    torch.manual_seed(4)
    logits = torch.randn(6, 300)
    strided = logits.t().contiguous().t()  # same values, not contiguous
    assert torch.equal(row_argmax(strided)[0], logits.argmax(dim=-1))
    half = logits.half()
    assert torch.equal(row_argmax(half)[0], half.argmax(dim=-1))


@pytest.mark.parametrize("shape", [(5,), (2, 0), (2, 3, 4)])
def test_bad_shapes_are_refused_by_name(shape):
    with pytest.raises(ValueError, match=r"row_argmax: logits must be \[rows, vocab\]"):
        row_argmax(torch.zeros(shape))


# ---- the LM head's picks, found as its rows are written (PackedLinear.with_argmax) -----------

def _lm_head(qtype: str, out_features: int, in_features: int = 128, seed: int = 0):
    from speculant.kernels.packed_linear import PackedLinear

    torch.manual_seed(seed)
    w = torch.randn(out_features, in_features)
    w[out_features // 2] = w[1]  # equal rows: exactly tied outputs in two far apart chunks
    w[out_features - 1] = w[1]
    return PackedLinear.from_float(w, qtype), w


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16", "F32"])
@pytest.mark.parametrize("rows", [1, 3, 9, 130])
def test_lm_head_picks_are_torch_argmax_of_its_logits(qtype, rows):
    """with_argmax: the logits __call__ gives, bit for bit, and each row's torch.argmax of
    them, whatever the rows (130: two passes of rows) and with ties across chunks of columns."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    lm, w = _lm_head(qtype, 2051)  # not a multiple of 8: a partial last group
    x = torch.randn(rows, 128)
    x[-1] = 4 * w[1]  # columns 1, 1025 and 2050 tie at the maximum: 1 wins
    x[0] = 0.0  # every logit 0: all tied, the first column wins
    logits, index = lm.with_argmax(x)
    assert torch.equal(logits, lm(x)) and index.dtype == torch.int64
    assert torch.equal(index, logits.argmax(dim=-1))
    assert index[0].item() == 0
    if rows > 1:
        assert logits[-1, 1] == logits[-1, 1025] == logits[-1, 2050] == logits[-1].max()
        assert index[-1].item() == 1


def test_lm_head_picks_the_first_nan_as_torch():
    """A column whose weights hold a NaN is NaN in every row: the pick, as torch.argmax's."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    from speculant.kernels.packed_linear import PackedLinear

    torch.manual_seed(1)
    w = torch.randn(1000, 64)
    w[700, 5] = float("nan")
    w[900, 0] = float("nan")
    lm = PackedLinear.from_float(w, "F32")
    logits, index = lm.with_argmax(torch.randn(4, 64))
    assert index.tolist() == logits.argmax(dim=-1).tolist() == [700] * 4


def test_lm_head_picks_fall_back_to_none_off_the_native_path():
    lm, _ = _lm_head("Q8_0", 40)
    x = torch.randn(2, 128)
    logits, index = lm.with_argmax(x, native=False)
    assert index is None and torch.equal(logits, lm(x, native=False))
