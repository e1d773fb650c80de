"""A bfloat16 KV cache in the AMX tiles' layout (kernels/kv_layout.py), attended straight from the
cache, every query position alike, on AMX-BF16 tiles (csrc/avx512/attention_tiles.cpp) or on
AVX512_BF16 dot products (attention_bf16dot.cpp; CPUs without AMX, or forced): the layout
round-trips, the native writer matches the PyTorch one bit for bit, attention on either stays
within bf16 rounding of exact attention over the cached values, is batch-invariant (a decode
token, a verification row and a prompt token at one position get the same bits), and speculative
output equals plain output on the default model. Tests that need a native bf16 attention skip on
CPUs without AVX512_BF16; the tiles' own variants skip without AMX-BF16.
"""
from __future__ import annotations

import pytest
import torch

from speculant.kernels import native_available, paged_attention
from speculant.kernels.kv_layout import (TILE_BLOCK, cache_block_size, cache_heads, gather_k,
                                         gather_v, k_cache_shape, v_cache_shape, write_kv)
from speculant.kernels.native import forced_kv_attention, kv_attention, tile_kv_cache
from speculant.kernels.rope import rope_cos_sin, rope_write_kv

HQ, HKV = 9, 3


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def require_tiles() -> None:
    if not tile_kv_cache():
        pytest.skip("this CPU attends no bfloat16 KV cache natively (needs avx512_bf16 and "
                    "avx512_vnni, and the native kernels)")


@pytest.fixture(params=["amx_bf16", "avx512_bf16"])
def bf16_attention(request):
    """Each native attention of a bf16 cache in turn: the tiles where the CPU has AMX-BF16, and
    the dot products (forced there; what auto runs elsewhere)."""
    require_tiles()
    if request.param == "amx_bf16" and kv_attention() != "amx_bf16":
        pytest.skip("this CPU has no AMX-BF16 tiles (needs amx_bf16 and the OS's leave)")
    with forced_kv_attention("auto" if request.param == "amx_bf16" else "avx512_bf16"):
        assert kv_attention() == request.param
        yield request.param


def tile_cache(num_blocks: int, head_dim: int, block_size: int = TILE_BLOCK):
    k = torch.zeros(k_cache_shape(num_blocks, block_size, HKV, head_dim, torch.bfloat16),
                    dtype=torch.bfloat16)
    v = torch.zeros(v_cache_shape(num_blocks, block_size, HKV, head_dim, torch.bfloat16),
                    dtype=torch.bfloat16)
    return k, v


def filled_cache(length: int, head_dim: int = 64, block_size: int = TILE_BLOCK, seed: int = 5):
    """`length` positions of one sequence on shuffled blocks (two spare ones), random K/V."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-length // block_size) + 2
    k_cache, v_cache = tile_cache(num_blocks, head_dim, block_size)
    table = torch.randperm(num_blocks, generator=g).to(torch.int32)[None]
    p = torch.arange(length)
    slots = table[0].long()[p // block_size] * block_size + p % block_size
    write_kv(k_cache, v_cache, slots, torch.randn(length, HKV, head_dim, generator=g),
             torch.randn(length, HKV, head_dim, generator=g))
    return k_cache, v_cache, table


def test_layout_round_trips_what_was_written():
    """write_kv then gather_k / gather_v give back each token's K and V rounded to bf16, at any
    slot of any block, and the cache reports its block size and heads."""
    k_cache, v_cache = tile_cache(4, 64)
    assert cache_block_size(v_cache) == TILE_BLOCK and cache_heads(v_cache) == (HKV, 64)
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([0, 1, 31, 32, 77, 127])
    k, v = torch.randn(6, HKV, 64, generator=g), torch.randn(6, HKV, 64, generator=g)
    write_kv(k_cache, v_cache, slots, k, v)
    assert torch.equal(gather_k(k_cache, slots, TILE_BLOCK), k.bfloat16())
    assert torch.equal(gather_v(v_cache, slots), v.bfloat16())
    # a pair row holds two positions: writing one leaves its neighbour alone
    assert torch.equal(gather_v(v_cache, torch.tensor([2, 30])),
                       torch.zeros(2, HKV, 64, dtype=torch.bfloat16))


def test_native_writer_matches_the_reference_bit_for_bit():
    """rope_write_kv's native path writes the same bf16 bits (round to nearest even) where the
    PyTorch reference does, and returns the same rotated queries."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    g = torch.Generator().manual_seed(2)
    D, T = 64, 7
    qkv = 3 * torch.randn(T, (HQ + 2 * HKV) * D, generator=g)
    cos, sin = rope_cos_sin(D, 10000.0, 256)
    positions = torch.tensor([0, 1, 2, 40, 41, 63, 200])
    slots = torch.tensor([5, 6, 7, 64, 65, 95, 3])
    caches = [tile_cache(4, D) for _ in range(2)]
    q = [rope_write_kv(qkv, None, None, None, 1e-5, cos, sin, positions, k, v, slots, HQ,
                       native=native) for (k, v), native in zip(caches, [True, False])]
    assert torch.equal(bits(q[0]), bits(q[1]))
    for a, b in zip(caches[0], caches[1]):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("num_tokens", [1, 4, 6, 17])
def test_tiles_stay_within_bf16_rounding_of_exact_attention(head_dim, block_size, num_tokens,
                                                            bf16_attention):
    """Against attention over the same cached bf16 values in fp32 (the PyTorch fallback), the
    only roundings are the bf16 query and softmax numerators: within 3e-3 at context ~700
    (three partitions), for verification chunks of 1-17 tokens."""
    length = 700
    k_cache, v_cache, table = filled_cache(length, head_dim, block_size)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(num_tokens, HQ, head_dim, generator=g)
    pos = torch.arange(length - num_tokens, length, dtype=torch.int32)
    seq = torch.zeros(num_tokens, dtype=torch.int32)
    args = (q, k_cache, v_cache, table, seq, pos, head_dim ** -0.5)
    tiles = paged_attention(*args, native=True)
    exact = paged_attention(*args, native=False)
    assert (tiles - exact).abs().max().item() < 3e-3


def test_a_position_gets_the_same_bits_whatever_else_is_in_the_batch(bf16_attention):
    """A token's output is bit-identical alone (a decode step), inside a verification chunk,
    inside a prompt batch from position 0, in a subset, and beside another sequence: the tile
    rows (the dot products' query groups) and the other queries never change it."""
    length = 600
    k_cache, v_cache, table = filled_cache(length)
    g = torch.Generator().manual_seed(4)
    q = 2 * torch.randn(length, HQ, 64, generator=g)
    seq, pos, scale = torch.zeros(length, dtype=torch.int32), torch.arange(length, dtype=torch.int32), 0.125
    full = paged_attention(q, k_cache, v_cache, table, seq, pos, scale)
    for t in [0, 1, 15, 16, 31, 32, 255, 256, 300, 599]:
        alone = paged_attention(q[t:t + 1], k_cache, v_cache, table, seq[:1], pos[t:t + 1], scale)
        assert torch.equal(bits(alone), bits(full[t:t + 1])), f"token {t}"
    chunk = slice(590, 600)  # a verification chunk of 10 rows
    part = paged_attention(q[chunk], k_cache, v_cache, table, seq[chunk], pos[chunk], scale)
    assert torch.equal(bits(part), bits(full[chunk]))
    subset = torch.tensor([3, 77, 78, 400, 599])
    part = paged_attention(q[subset], k_cache, v_cache, table, seq[subset], pos[subset], scale)
    assert torch.equal(bits(part), bits(full[subset]))
    both = paged_attention(torch.cat([q[:5], q[599:600]]), k_cache, v_cache, table.repeat(2, 1),
                           torch.tensor([0] * 5 + [1], dtype=torch.int32),
                           torch.tensor([0, 1, 2, 3, 4, 599], dtype=torch.int32), scale)
    assert torch.equal(bits(both), bits(full[[0, 1, 2, 3, 4, 599]]))


def test_a_bad_tile_cache_is_refused_by_name():
    """A bf16 cache whose shapes are not the tiles' layout, or whose block size the tiles cannot
    take, stops with the problem named."""
    require_tiles()
    k_cache, v_cache, table = filled_cache(40)
    q = torch.randn(1, HQ, 64)
    idx = (table, torch.zeros(1, dtype=torch.int32), torch.tensor([39], dtype=torch.int32), 0.125)
    op = torch.ops.speculant.paged_attention.default
    with pytest.raises(RuntimeError, match="tiles' layout"):
        op(q, k_cache.flatten(3), v_cache, *idx)
    with pytest.raises(RuntimeError, match="K and V both bfloat16"):
        op(q, k_cache, v_cache.half(), *idx)
    k16, v16 = tile_cache(6, 64, block_size=16)
    with pytest.raises(RuntimeError, match="block_size a multiple of 32"):
        op(q, k16, v16, *idx)


def test_config_resolves_and_checks_the_tile_cache():
    """bfloat16 takes 32-position blocks by default and refuses others by name; auto picks it
    where the CPU attends it on tiles (never with float32 weights)."""
    from speculant.engine.config import EngineConfig

    assert EngineConfig(kv_dtype="bfloat16").block_size == TILE_BLOCK
    assert EngineConfig(kv_dtype="float16").block_size == 16
    with pytest.raises(ValueError, match="kv_dtype bfloat16 needs block_size a multiple of 32"):
        EngineConfig(kv_dtype="bfloat16", block_size=16)
    assert EngineConfig(dtype="float32").kv_dtype == "float32"
    assert EngineConfig().kv_dtype == ("bfloat16" if tile_kv_cache() else "float16")
    assert EngineConfig(block_size=16).kv_dtype == "float16"  # auto keeps what the blocks take


def test_engine_refuses_a_tile_cache_the_cpu_cannot_attend(monkeypatch):
    """On a CPU without the tiles, asking for bfloat16 stops at start-up, naming what is
    missing and what to use instead."""
    import speculant.engine.engine as engine_module
    from speculant.engine.config import EngineConfig

    monkeypatch.setattr(engine_module, "tile_kv_cache", lambda: False)
    with pytest.raises(ValueError, match="needs a CPU with AVX512_BF16.*use float16"):
        engine_module.Engine(EngineConfig(kv_dtype="bfloat16"))


def test_speculative_output_equals_plain_on_a_tile_cache(default_engine, bf16_attention):
    """The default model on a bfloat16 tile cache: greedy speculative decoding writes plain
    decoding's tokens, one sequence at a time and four together (every generated position
    takes the one path whether it is decoded or verified)."""
    from conftest import decode_all, dev_prompts
    from speculant.engine.config import EngineConfig
    from speculant.engine.engine import Engine
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    engine = Engine(EngineConfig(kv_dtype="bfloat16", spec_type=["ngram_mod", "suffix"]),
                    model_from=default_engine)
    tokenizer = engine.tokenizer
    texts = [p.turns[0] for p in dev_prompts(["summarization", "code_edit", "qa"], 1)]
    texts.append("Repeat after me: alpha beta gamma delta, alpha beta gamma delta, alpha beta")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    plain = SamplingParams(max_tokens=64, temperature=0.0, spec=SpecParams(enabled=False))
    spec = SamplingParams(max_tokens=64, temperature=0.0,
                          spec=SpecParams(types=["ngram_mod", "suffix"]))
    want = [s.output_ids for s in decode_all(engine, prompts, plain, batch=1)]
    assert [s.output_ids for s in decode_all(engine, prompts, spec, batch=1)] == want
    batched = decode_all(engine, prompts, spec, batch=4)
    assert [s.output_ids for s in batched] == want
    assert sum(s.spec.num_accepted_tokens for s in batched) > 0  # drafts were verified


def test_tile_cache_moves_the_models_logits_no_more_than_the_fp16_cache(default_engine):
    """The default model's logits over a real prompt, every position attended from the cache:
    a bfloat16 tile cache sits about as close to an fp32 cache's logits as the fp16 cache does
    (measured 0.167-0.169 against 0.167-0.184; the int8 activations of every layer dominate)."""
    require_tiles()
    from conftest import dev_prompts
    from speculant.engine.forward_batch import SeqChunk, build_forward_batch

    model, tokenizer = default_engine.model, default_engine.tokenizer
    ids = tokenizer.encode(dev_prompts(["summarization"], 1)[0].turns[0])[:800]

    def logits(dtype: torch.dtype, block_size: int) -> torch.Tensor:
        cache = model.new_kv_cache(len(ids) // block_size + 2, block_size, dtype)
        cache.allocate(0)
        chunk = SeqChunk(0, 0, ids, num_logits=len(ids))  # no prompt marks: generated positions' path
        return model.forward(build_forward_batch(cache, [chunk]), cache).logits

    fp32 = logits(torch.float32, 16)
    tiles_gap = (logits(torch.bfloat16, TILE_BLOCK) - fp32).abs().mean().item()
    fp16_gap = (logits(torch.float16, 16) - fp32).abs().mean().item()
    print(f"mean logit gap from an fp32 cache: bf16 tiles {tiles_gap:.4f}, fp16 {fp16_gap:.4f}")
    assert 0 < tiles_gap < 1.25 * fp16_gap


def test_the_dot_products_and_the_tiles_agree_to_bf16_rounding():
    """On a CPU with both, the two attentions of a bf16 cache read the same operands and differ
    only in the order each adds its fp32 products: within 1e-4 of each other."""
    require_tiles()
    if kv_attention() != "amx_bf16":
        pytest.skip("this CPU has no AMX-BF16 tiles to compare the dot products with")
    k_cache, v_cache, table = filled_cache(700)
    q = torch.randn(6, HQ, 64, generator=torch.Generator().manual_seed(6))
    args = (q, k_cache, v_cache, table, torch.zeros(6, dtype=torch.int32),
            torch.arange(694, 700, dtype=torch.int32), 0.125)
    tiles = paged_attention(*args)
    with forced_kv_attention("avx512_bf16"):
        dots = paged_attention(*args)
    assert (tiles - dots).abs().max().item() < 1e-4


def test_a_kv_attention_mode_this_cpu_lacks_is_refused_by_name():
    """set_kv_attention takes auto or avx512_bf16, and refuses avx512_bf16 where the CPU has no
    AVX512_BF16, naming it."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    with pytest.raises(RuntimeError, match="expected auto or avx512_bf16"):
        with forced_kv_attention("bf16"):
            pass
    if tile_kv_cache():
        assert kv_attention() in ("amx_bf16", "avx512_bf16")
    else:
        assert kv_attention() == "none"
        with pytest.raises(RuntimeError, match="lacks AVX512_BF16"):
            with forced_kv_attention("avx512_bf16"):
                pass
