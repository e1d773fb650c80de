"""Shared fixtures: the default model engine (loaded once per session) and tiny HF models."""
import os
import shutil

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV_PROMPTS = os.path.join(REPO, "..", "shared", "data", "prompts_dev.jsonl")

# CI runs alone on the machine: 2 threads. Set SPECULANT_TEST_THREADS=1 when other jobs share
# the cores (2-thread barriers then wait for time slices and everything slows ~10x).
TEST_THREADS = int(os.environ.get("SPECULANT_TEST_THREADS", min(2, os.cpu_count() or 1)))
torch.set_num_threads(TEST_THREADS)


@pytest.fixture(scope="session")
def default_tokenizer_dir(tmp_path_factory):
    """The default model's tokenizer files (converted from its GGUF), for tiny test models."""
    from speculant.models.loader import resolve_model
    from speculant.models.tokenizer import _gguf_tokenizer_files

    files = _gguf_tokenizer_files(resolve_model("default").path)
    return os.path.dirname(files.tokenizer_json)


def save_tiny_hf_model(folder, tokenizer_dir, model_type: str, seed: int = 0, num_layers: int = 2):
    """A randomly initialised Llama/Qwen2/Qwen3 saved by transformers, with the default tokenizer."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif model_type == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif model_type == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(model_type)
    model.save_pretrained(folder)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), folder)
    return model.eval()


@pytest.fixture(scope="session")
def default_engine():
    """The default model (quantized weights, native kernels) with every model-free speculator."""
    from speculant.engine.engine import Engine
    from speculant.speculators.registry import registered_names, speculator_class

    names = [n for n in registered_names()
             if n != "synthetic" and not speculator_class(n).is_model_based]
    return Engine(model="default", spec_type=names, max_num_seqs=8, kv_cache_tokens=32768,
                  num_threads=TEST_THREADS)


def decode_all(engine, prompts, params, batch=None):
    """Add every prompt, step the engine until all finish, release them; returns the sequences.
    `batch` caps how many decode together (the scheduler's max_num_seqs)."""
    if batch is not None:
        engine.set_limits(max_num_seqs=batch)
    return engine.run_to_completion(prompts, params)


def dev_prompts(categories, limit):
    from speculant.data.prompt_set import read_prompts

    if not os.path.exists(DEV_PROMPTS):
        pytest.skip(f"dev prompts not found at {DEV_PROMPTS}")
    return read_prompts(DEV_PROMPTS, categories, limit)
