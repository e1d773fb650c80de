"""GPTQ for drafter heads: plain GGML blocks that the packed kernels run bit for bit, less output
error than ggml's reference rounding where the inputs are correlated, no error feedback where
they are not; the file beside a head round-trips and a file that does not fit is refused by
name; pack_linears takes the file's blocks."""
import copy

import pytest
import torch
from torch import nn

from speculant.kernels import ggml_blocks, native_available
from speculant.kernels.packed_linear import PackedLinear
from speculant.models.head_quant import (DequantizedLinear, gptq_blocks, load_packed,
                                         packed_file, quantize_head, save_packed, with_blocks)
from speculant.models.packed_head import load_head_blocks, pack_linears

QTYPES = ["Q4_1", "Q4_0", "Q8_0"]


def correlated_inputs(num_rows: int, width: int, seed: int) -> torch.Tensor:
    """[num_rows, width]: a few strong directions mixed into every column, as a layer's
    activations are (GPTQ's error feedback has something to exploit)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, width, generator=g)
    return torch.randn(num_rows, 8, generator=g) @ basis + 0.1 * torch.randn(num_rows, width, generator=g)


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    return float((x @ (approx - weight).T).norm() / (x @ weight.T).norm())


@pytest.mark.parametrize("qtype", QTYPES)
def test_gptq_leaves_less_output_error_than_reference_rounding(qtype):
    """On correlated inputs the error fed forward leaves X W^T closer to the float product."""
    weight = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    x = correlated_inputs(512, 128, seed=2)
    gptq = ggml_blocks.dequantize(gptq_blocks(weight, x.T.double() @ x.double(), qtype))
    reference = ggml_blocks.dequantize(ggml_blocks.quantize(weight, qtype))
    assert output_error(x, weight, gptq) < 0.8 * output_error(x, weight, reference)


# Q4_1's grid spans its block; Q4_0's stops one step short of minus its peak (-8..7 steps)
@pytest.mark.parametrize("qtype,steps", [("Q4_1", 0.5), ("Q4_0", 1.0)])
def test_uncorrelated_inputs_round_every_weight_to_its_own_grid(qtype, steps):
    """A diagonal gram feeds no error forward: each weight rounds to its block's own grid (the
    grid ggml's reference picks), within half a step of it."""
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    blocks = gptq_blocks(weight, torch.diag(torch.rand(64) + 0.5), qtype)
    step = blocks.scales.float().abs().repeat_interleave(32, dim=1)  # [16, 64]
    error = (ggml_blocks.dequantize(blocks) - weight).abs()
    assert (error <= steps * step + 1e-4).all()
    assert (error <= step / 2 + 1e-4).float().mean() > 0.97  # all but Q4_0's clamped ends


@pytest.mark.skipif(not native_available(), reason="the packed kernels are native")
@pytest.mark.parametrize("qtype", QTYPES)
def test_gptq_blocks_run_on_the_packed_kernels_as_their_dequantized_weights(qtype):
    """The blocks are plain GGML: packed, the kernels compute the dequantized weights' product
    with the activations rounded as they round them."""
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    x = correlated_inputs(64, 96, seed=5)
    blocks = gptq_blocks(weight, x.T.double() @ x.double(), qtype)
    got = PackedLinear.from_blocks(blocks)(x[:5].contiguous())
    want = DequantizedLinear(blocks)(x[:5])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(64, 32, bias=False))
        self.unused = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.inner(x)


def test_a_linear_the_calibration_never_reaches_keeps_reference_rounding():
    torch.manual_seed(6)
    module = TwoLinears()
    x = correlated_inputs(128, 64, seed=7)
    blocks = quantize_head(module, lambda: module(x), "Q4_1")
    assert set(blocks) == {"inner.0.weight", "unused.weight"}
    ref = ggml_blocks.quantize(module.unused.weight, "Q4_1")
    assert torch.equal(blocks["unused.weight"].qs, ref.qs)
    assert torch.equal(blocks["unused.weight"].scales, ref.scales)
    # the calibrated one is GPTQ's: it differs from the reference somewhere
    assert not torch.equal(blocks["inner.0.weight"].qs,
                           ggml_blocks.quantize(module.inner[0].weight, "Q4_1").qs)
    # with_blocks swaps in what the packed kernels compute
    swapped = with_blocks(copy.deepcopy(module), blocks)
    assert isinstance(swapped.inner[0], DequantizedLinear)
    assert isinstance(swapped.unused, DequantizedLinear)


def test_the_file_beside_a_head_round_trips_and_a_misfit_is_refused_by_name(tmp_path):
    torch.manual_seed(8)
    module = TwoLinears()
    blocks = quantize_head(module, lambda: module(correlated_inputs(64, 64, 9)), "Q4_1")
    save_packed(str(tmp_path), blocks, "Q4_1", {"method": "gptq"})
    shapes = {"inner.0.weight": (32, 64), "unused.weight": (16, 32)}
    back = load_packed(str(tmp_path), "Q4_1", shapes)
    for key, b in blocks.items():
        assert torch.equal(back[key].qs, b.qs) and torch.equal(back[key].scales, b.scales)
        assert torch.equal(back[key].mins, b.mins)
    assert load_packed(str(tmp_path), "Q8_0", shapes) is None  # no Q8_0 file: none
    with pytest.raises(ValueError, match=r"inner\.0\.weight .*expected uint8 \[32, 60\]"):
        load_packed(str(tmp_path), "Q4_1", {**shapes, "inner.0.weight": (32, 96)})
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    save_packed(str(wrong), blocks, "Q4_1", {})
    (wrong / "model.q4_1.safetensors").rename(wrong / "model.q4_0.safetensors")
    with pytest.raises(ValueError, match=r"model\.q4_0\.safetensors: holds 'Q4_1' blocks"):
        load_packed(str(wrong), "Q4_0", shapes)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.q4_1.safetensors").write_bytes(b"\x00\x01not safetensors")
    with pytest.raises(ValueError, match=r"model\.q4_1\.safetensors: not a safetensors file"):
        load_packed(str(broken), "Q4_1", shapes)


@pytest.mark.skipif(not native_available(), reason="packed weights run on the native kernels")
def test_pack_linears_takes_the_heads_blocks_and_rounds_the_rest(tmp_path):
    torch.manual_seed(10)
    module = TwoLinears()
    blocks = quantize_head(module, lambda: module(correlated_inputs(64, 64, 11)), "Q4_1")
    save_packed(str(tmp_path), {"inner.0.weight": blocks["inner.0.weight"]}, "Q4_1", {})
    found = load_head_blocks(module, str(tmp_path), "q4_1")
    assert set(found) == {"inner.0.weight"}
    float_weights = {k: m.weight.detach().clone() for k, m in
                     (("inner", module.inner[0]), ("unused", module.unused))}
    assert pack_linears(module, "q4_1", found) == 2
    assert torch.equal(module.inner[0].packed.data,
                       PackedLinear.from_blocks(blocks["inner.0.weight"]).data)
    assert torch.equal(module.unused.packed.data,
                       PackedLinear.from_float(float_weights["unused"], "Q4_1").data)
    assert packed_file(str(tmp_path), "Q4_1").endswith("model.q4_1.safetensors")
