"""Hybrid configs: what loads, and what is refused at load, by name."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from hybrid_models import hf_config, save_hf_model  # noqa: E402

from speculant.models.config import ModelConfig, UnsupportedArchitectureError  # noqa: E402
from speculant.models.loader import hf_model_config  # noqa: E402
from speculant.models.hybrid_config import HybridConfig  # noqa: E402
from speculant.models.loader import load_model  # noqa: E402


def config_dict(family: str, **overrides) -> dict:
    return hf_config(family, **overrides).to_dict()


def test_layer_kinds_and_state_shapes_read_from_transformers_configs():
    """LFM2: conv/attention by full_attn_idxs; Qwen3-Next: 3 DeltaNet layers per attention one."""
    lfm2 = hf_model_config(config_dict("lfm2"))
    assert isinstance(lfm2, HybridConfig) and lfm2.is_hybrid
    assert lfm2.layer_kinds == ("conv", "attention", "conv", "attention")
    assert lfm2.conv_channels(0) == 256 and lfm2.conv_kernel == 3
    q3n = hf_model_config(config_dict("qwen3_next", num_layers=8))
    assert q3n.layer_kinds == ("deltanet",) * 3 + ("attention",) + ("deltanet",) * 3 + ("attention",)
    assert q3n.conv_channels(0) == 2 * 2 * 32 + 4 * 32 and q3n.rotary_dim == 8


def test_llama_configs_are_not_hybrid():
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 100}
    assert not hf_model_config(cfg).is_hybrid


@pytest.mark.parametrize("model_type", ["lfm2_moe", "qwen3_5_text", "mamba2", "falcon_h1"])
def test_unsupported_architecture_refused_by_name(model_type):
    cfg = dict(config_dict("lfm2"), model_type=model_type, architectures=["X"])
    with pytest.raises(UnsupportedArchitectureError, match=model_type):
        hf_model_config(cfg)


@pytest.mark.parametrize("family, layer_type", [("lfm2", "sliding_attention"),
                                                ("qwen3_next", "mamba")])
def test_unsupported_layer_type_refused_naming_it_and_its_layer(family, layer_type):
    """A state layout we do not run (a layer type outside the family's) never loads."""
    cfg = config_dict(family)
    cfg["layer_types"] = list(cfg["layer_types"])
    cfg["layer_types"][2] = layer_type
    with pytest.raises(UnsupportedArchitectureError, match=f"layer 2 has type '{layer_type}'"):
        hf_model_config(cfg)


def test_unsupported_rope_and_head_grouping_refused_by_name():
    cfg = config_dict("qwen3_next")
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        hf_model_config(cfg)
    cfg = dict(config_dict("qwen3_next"), linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(UnsupportedArchitectureError, match="linear_num_value_heads"):
        hf_model_config(cfg)


def test_hybrid_gguf_architecture_refused_with_a_hint():
    with pytest.raises(UnsupportedArchitectureError, match="'lfm2' .*Hugging Face folder"):
        ModelConfig.from_gguf_fields({"general.architecture": "lfm2"})


def test_quantized_dtype_refused_for_hybrids(tmp_path):
    save_hf_model(tmp_path, "lfm2", hidden=64)
    with pytest.raises(ValueError, match="lfm2 models run in float32; dtype 'q8_0'"):
        load_model(str(tmp_path), dtype="q8_0")


def test_folder_with_unsupported_architecture_refused_at_load(tmp_path):
    """The whole load path refuses it, before any weight is read."""
    save_hf_model(tmp_path, "lfm2", hidden=64)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), model_type="lfm2_moe",
                                    architectures=["Lfm2MoeForCausalLM"])))
    with pytest.raises(UnsupportedArchitectureError, match="lfm2_moe"):
        load_model(str(tmp_path))
