"""Hybrid models from GGUF files as llama.cpp's converter writes them (`hybrid_gguf_writer`:
its names, metadata and value transforms): logits equal transformers' on the model the file came
from, F16 / BF16 / Q8_0 files load exactly, the engine generates from them, and files that do
not fit are refused by name."""
import os
import sys

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from hybrid_gguf_writer import stored_as, write_gguf  # noqa: E402
from hybrid_models import VOCAB, Runner, hf_logits, save_hf_model  # noqa: E402

from speculant.engine.forward_batch import SeqChunk  # noqa: E402
from speculant.models.config import UnsupportedArchitectureError  # noqa: E402
from speculant.models.hybrid import hybrid_model  # noqa: E402
from speculant.models.loader import load_model  # noqa: E402

TOL = 1e-3
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
           shared_expert_intermediate_size=128)
VARIANTS = {
    # name: (family, transformers config overrides); 4 layers, hidden 128
    "lfm2": ("lfm2", {}),  # conv, attention, conv, attention
    # llama.cpp writes MoE Qwen3-Next only; a dense one takes the names its dense branch reads
    "qwen3_next_dense": ("qwen3_next", {}),
    "qwen3_next_moe": ("qwen3_next", MOE),  # every layer MoE, as llama.cpp requires
    # attention at layers 1 and 3: only `attention.recurrent_layers` says so (the interval is 4)
    "qwen3_next_layer_types": ("qwen3_next", dict(MOE, layer_types=[
        "linear_attention", "full_attention", "linear_attention", "full_attention"])),
}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Converted-tensor and tokenizer caches in a temporary folder, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECULANT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Variant name -> (transformers model, its folder); built once per module."""
    out = {}
    for name, (family, overrides) in VARIANTS.items():
        folder = tmp_path_factory.mktemp(name)
        hf = save_hf_model(folder, family, seed=0, num_layers=4, hidden=128, **overrides)
        out[name] = hf, folder
    return out


def from_gguf(path):
    loaded = load_model(str(path))
    return hybrid_model(loaded.config, loaded.weights)


def logits(model, ids: list[int]) -> torch.Tensor:
    runner = Runner(model)
    runner.add(0)
    return runner.run([SeqChunk(0, 0, ids, num_logits=len(ids))]).logits


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_dev(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("variant", ["lfm2", "qwen3_next_dense", "qwen3_next_moe"])
def test_fp32_gguf_logits_match_transformers(hf_models, variant):
    """Every position of a 1- and a 50-token prompt (token-by-token and chunked delta rule)."""
    hf, folder = hf_models[variant]
    ours = from_gguf(write_gguf(hf, folder / "f32.gguf"))
    for ids in (tokens(1, seed=1), tokens(50, seed=2)):
        assert max_dev(logits(ours, ids), hf_logits(hf, ids)) < TOL


def test_newer_converter_file_with_mtp_block_loads_the_trunk(hf_models):
    """A file as newer converters write it: per-layer `attention.recurrent_layers` flags (here
    not the interval's pattern) and an MTP block appended as blk.4 (nextn_predict_layers = 1),
    which the target skips."""
    hf, folder = hf_models["qwen3_next_layer_types"]
    path = write_gguf(hf, folder / "mtp.gguf", mtp_block=True)
    loaded = load_model(path)
    assert loaded.config.layer_kinds == ("deltanet", "attention") * 2
    ours = hybrid_model(loaded.config, loaded.weights)
    ids = tokens(40, seed=4)
    assert max_dev(logits(ours, ids), hf_logits(hf, ids)) < TOL


def rounded_to(hf, qtype: str):
    """A copy of `hf` whose matrices hold what `qtype` stores of them. Row blocks are the
    same in the file: llama.cpp's reorderings move whole rows (or whole experts)."""
    import copy

    twin = copy.deepcopy(hf)
    with torch.no_grad():
        for p in twin.parameters():
            q = gguf.GGMLQuantizationType[stored_as(tuple(p.shape), qtype)]
            data = p.numpy().astype(np.float32)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(data, q), q)
                                     .reshape(data.shape)))
    return twin


@pytest.mark.parametrize("variant,qtype", [("lfm2", "F16"), ("qwen3_next_dense", "BF16"),
                                           ("lfm2", "Q8_0"), ("qwen3_next_moe", "Q8_0")])
def test_lower_precision_gguf_is_dequantized_exactly(hf_models, variant, qtype):
    """An F16 / BF16 / Q8_0 file runs as transformers does on the weights rounded to that
    type, and the rounding explains the file better than the original weights do (its blocks
    were really read; Q8_0 MoE routing included)."""
    hf, folder = hf_models[variant]
    ours = from_gguf(write_gguf(hf, folder / f"{qtype}.gguf", qtype=qtype))
    ids = tokens(30, seed=3)
    got = logits(ours, ids)
    to_rounded = max_dev(got, hf_logits(rounded_to(hf, qtype), ids))
    assert to_rounded < TOL and max_dev(got, hf_logits(hf, ids)) > 10 * to_rounded


@pytest.mark.parametrize("variant", ["lfm2", "qwen3_next_moe"])
def test_llm_generates_from_gguf_as_transformers_does(hf_models, variant):
    """LLM(model=file.gguf): the file's own tokenizer (qwen3next: an architecture transformers
    has no GGUF config for), then greedy tokens equal to transformers' generate."""
    from speculant.engine.sampling_params import SamplingParams
    from speculant.llm import LLM

    hf, folder = hf_models[variant]
    llm = LLM(model=write_gguf(hf, folder / "llm.gguf"), kv_cache_tokens=512, max_model_len=512,
              max_num_seqs=2)
    ids = llm.tokenizer.encode("the earth is a hot tin roof")
    assert llm.tokenizer.decode(ids) == "the earth is a hot tin roof"
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert out[0].token_ids == ref.tolist()


def drop(target):
    return lambda name, data: None if name == target else data


def replace(target, fn):
    return lambda name, data: fn(data) if name == target else data


REFUSALS = [
    # (variant, general.architecture written, tensor edit, error, message naming the cause)
    ("lfm2", "lfm2moe", None, UnsupportedArchitectureError, "'lfm2moe'"),  # LFM2-MoE: not ours
    ("qwen3_next_dense", "qwen35", None, UnsupportedArchitectureError, "'qwen35'"),
    ("lfm2", None, drop("blk.1.attn_k.weight"), ValueError, "missing tensor 'blk.1.attn_k.weight'"),
    ("qwen3_next_moe", None, drop("blk.0.ffn_up_exps.weight"), ValueError,
     "missing tensor 'blk.0.ffn_up_exps.weight'"),
    # a conv kernel left unsqueezed [hidden, 1, K]: not what llama.cpp writes
    ("lfm2", None, replace("blk.0.shortconv.conv.weight", lambda d: d[:, None, :]), ValueError,
     "'blk.0.shortconv.conv.weight' has shape"),
    # layers that do not follow full_attention_interval, without recurrent_layers flags
    ("qwen3_next_layer_types", None, None, ValueError, "missing tensor 'blk.1.ssm_a'"),
    # the decay exp(A_log) written without llama.cpp's minus sign
    ("qwen3_next_dense", None, replace("blk.0.ssm_a", lambda d: -d), ValueError, "blk.0.ssm_a"),
]


@pytest.mark.parametrize("variant,arch,edit,error,message", REFUSALS)
def test_unfit_gguf_refused_at_load_by_name(hf_models, tmp_path, variant, arch, edit, error,
                                           message):
    hf, _ = hf_models[variant]
    path = write_gguf(hf, tmp_path / "bad.gguf", arch_name=arch, edit=edit)
    with pytest.raises(error, match=message.replace("[", r"\[")):
        load_model(path)
