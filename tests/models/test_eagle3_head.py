"""EAGLE-3 head: published-layout round trip, load-time refusal of heads that do not fit the
target, layer-id conversion, and the per-step maths against a plain Llama-layer reference."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from speculant.models.config import ModelConfig
from speculant.models.eagle3_head import (Eagle3Head, aux_to_capture_layers,
                                          capture_to_aux_layers, default_aux_layer_ids)

TARGET = ModelConfig(architecture="llama", num_layers=8, hidden_size=32, intermediate_size=64,
                     num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=100,
                     max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-5,
                     tie_word_embeddings=True)
DRAFT_IDS = [2, 5, 7, 11, 40, 99]
PUBLISHED_KEYS = {  # vLLM / SpecForge / EAGLE repository names and shapes for TARGET
    "fc.weight": [32, 96], "midlayer.input_layernorm.weight": [32],
    "midlayer.hidden_norm.weight": [32], "midlayer.self_attn.q_proj.weight": [32, 64],
    "midlayer.self_attn.k_proj.weight": [16, 64], "midlayer.self_attn.v_proj.weight": [16, 64],
    "midlayer.self_attn.o_proj.weight": [32, 32],
    "midlayer.post_attention_layernorm.weight": [32], "midlayer.mlp.gate_proj.weight": [64, 32],
    "midlayer.mlp.up_proj.weight": [64, 32], "midlayer.mlp.down_proj.weight": [32, 64],
    "norm.weight": [32], "lm_head.weight": [6, 32], "d2t": [6], "t2d": [100],
}


@pytest.fixture
def saved_head(tmp_path):
    head = Eagle3Head.random(TARGET, DRAFT_IDS, seed=1)
    head.save(str(tmp_path), dtype=torch.float32)
    return head, str(tmp_path)


def test_save_writes_the_published_layout(saved_head):
    _, path = saved_head
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert {k: list(v.shape) for k, v in tensors.items()} == PUBLISHED_KEYS
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 6 and cfg["target_hidden_size"] == 32
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_round_trip_is_bit_exact(saved_head):
    head, path = saved_head
    loaded = Eagle3Head.load(path, TARGET)
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.capture_layers == (1, 3, 4)


def test_d2t_maps_draft_ids_to_target_ids(saved_head):
    head, _ = saved_head
    assert head.draft_to_target(torch.arange(6)).tolist() == DRAFT_IDS
    assert head.t2d.nonzero().flatten().tolist() == DRAFT_IDS


def edit_config(path, **changes):
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("changes, message", [
    # a head made for a wider target
    ({"hidden_size": 64, "target_hidden_size": 64}, "hidden size 32"),
    # aux layer ids beyond the target's 8 layers
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 9]}}, "8 layers"),
    # the embedding (id 0) is not something the engine captures
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 4, 5]}}, "8 layers"),
    # another tokenizer's vocabulary
    ({"vocab_size": 128}, "vocabulary size 100"),
    # not an EAGLE-3 head at all
    ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head"),
])
def test_load_refuses_a_head_that_does_not_fit(saved_head, changes, message):
    _, path = saved_head
    edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        Eagle3Head.load(path, TARGET)


def test_load_refuses_a_tensor_of_the_wrong_shape(tmp_path):
    """A config that fits but weights that do not (here: another draft vocabulary size)."""
    Eagle3Head.random(TARGET, DRAFT_IDS, seed=1).save(str(tmp_path))
    edit_config(str(tmp_path), draft_vocab_size=7)
    with pytest.raises(ValueError, match=r"has shape \[6\], expected \[7\]"):
        Eagle3Head.load(str(tmp_path), TARGET)


def test_layer_ids_convert_between_published_and_capture_conventions():
    """Published ids name layer inputs; the engine captures layer outputs (one lower)."""
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert aux_to_capture_layers((2, 15, 27)) == (1, 14, 26)
    assert capture_to_aux_layers((1, 14, 26)) == (2, 15, 27)


def test_embedding_comes_from_the_target_unless_the_checkpoint_has_one(tmp_path):
    head = Eagle3Head.random(TARGET, DRAFT_IDS, seed=1)
    with pytest.raises(RuntimeError, match="embedding"):
        head.embed(torch.tensor([1]))
    table = torch.randn(100, 32)
    head.use_target_embedding(table)
    assert torch.equal(head.embed(torch.tensor([3, 4])), table[[3, 4]])
    head.embed_tokens = torch.nn.Embedding.from_pretrained(table * 2)
    head.save(str(tmp_path), dtype=torch.float32)
    assert torch.equal(Eagle3Head.load(str(tmp_path), TARGET).embed(torch.tensor([3])), 2 * table[[3]])


def test_rope_matches_the_kernels_convention():
    """apply_rope equals speculant.kernels.rope's HF rotate_half rotation at the same positions."""
    from speculant.kernels.rope import apply_rope, rope_cos_sin

    head = Eagle3Head.random(TARGET, DRAFT_IDS, seed=1)
    x, pos = torch.randn(5, 4, 8), torch.tensor([0, 1, 7, 30, 127])
    cos, sin = rope_cos_sin(8, 10000.0, 128)
    expected = apply_rope(x, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    assert torch.equal(head.apply_rope(x, pos), expected)


def test_one_step_equals_a_reference_llama_layer_on_the_concatenated_input():
    """A single token (attention = its own v): h_out = hidden + o(v) + mlp(post_norm(...)),
    with q/k/v reading concat(input_norm(embed), hidden_norm(hidden)); logits on draft ids."""
    torch.manual_seed(0)
    head = Eagle3Head.random(TARGET, DRAFT_IDS, seed=2)
    head.use_target_embedding(torch.randn(100, 32))
    m = head.midlayer
    feats = torch.randn(1, 96)
    hidden = head.fuse(feats)
    q, k, v, residual = head.project_qkv(head.embed(torch.tensor([5])), hidden)
    assert q.shape == (1, 4, 8) and k.shape == (1, 2, 8) and torch.equal(residual, hidden)
    attn = v.repeat_interleave(2, dim=1).reshape(1, 32)  # softmax over one key: weight 1
    out = head.finish(attn, residual)
    r = hidden + m.self_attn.o_proj(attn)
    x = m.post_attention_layernorm(r)
    expected = r + m.mlp.down_proj(torch.nn.functional.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))
    torch.testing.assert_close(out, expected)
    assert head.draft_logits(out).shape == (1, 6)


def test_a_deeper_head_writes_its_further_layers_as_layers_i(tmp_path):
    """A head of 3 decoder layers (`train-head --head-layers 3`) keeps the published names of
    the first (`midlayer.*`) and writes the others as Llama decoder layers reading d,
    `layers.1.*` and `layers.2.*` (the convention that calls the first `layers.0`), with
    `num_hidden_layers` 3; it loads back bit-exact."""
    head = Eagle3Head.random(TARGET, DRAFT_IDS, seed=1, num_layers=3)
    head.save(str(tmp_path), dtype=torch.float32)
    tensors = load_file(os.path.join(str(tmp_path), "model.safetensors"))
    further = {k: list(v.shape) for k, v in tensors.items() if k.startswith("layers.")}
    per_layer = {"input_layernorm.weight": [32], "self_attn.q_proj.weight": [32, 32],
                 "self_attn.k_proj.weight": [16, 32], "self_attn.v_proj.weight": [16, 32],
                 "self_attn.o_proj.weight": [32, 32], "post_attention_layernorm.weight": [32],
                 "mlp.gate_proj.weight": [64, 32], "mlp.up_proj.weight": [64, 32],
                 "mlp.down_proj.weight": [32, 64]}
    assert further == {f"layers.{i}.{k}": v for i in (1, 2) for k, v in per_layer.items()}
    assert {k: list(v.shape) for k, v in tensors.items()
            if not k.startswith("layers.")} == PUBLISHED_KEYS
    with open(os.path.join(str(tmp_path), "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 3
    loaded = Eagle3Head.load(str(tmp_path), TARGET)
    assert loaded.num_layers == 3
    for (name, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("layers", [0, 9])
def test_load_refuses_a_layer_count_it_cannot_run(saved_head, layers):
    _, path = saved_head
    edit_config(path, num_hidden_layers=layers)
    with pytest.raises(ValueError, match=f"{layers} decoder layers"):
        Eagle3Head.load(path, TARGET)


def test_load_refuses_a_deeper_config_than_its_weights(saved_head):
    """config.json says two layers, the weights hold one: the missing tensors are named."""
    _, path = saved_head
    edit_config(path, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.1\."):
        Eagle3Head.load(path, TARGET)


def test_a_further_layer_is_a_llama_decoder_layer_on_the_first_ones_output():
    """run_layers over one token: layer 0 is the EAGLE-3 step, layer 1 a plain Llama layer on
    its output (q/k/v read input_norm(h), residual h); each layer attends with its own keys."""
    from speculant.models.eagle3_head import run_layers

    torch.manual_seed(0)
    head = Eagle3Head.random(TARGET, DRAFT_IDS, seed=2, num_layers=2)
    head.use_target_embedding(torch.randn(100, 32))
    hidden = head.fuse(torch.randn(1, 96))
    embeds = head.embed(torch.tensor([5]))
    seen = []

    def attend(layer, q, k, v):  # one key: the softmax weight is 1, the output is v
        seen.append((layer, q.shape, k.shape))
        return v.repeat_interleave(2, dim=1).reshape(1, 32)

    out = run_layers(head, embeds, hidden, attend)
    q, k, v, residual = head.project_qkv(embeds, hidden)
    h0 = head.finish(v.repeat_interleave(2, dim=1).reshape(1, 32), residual)
    m = head.layers["1"]
    v1 = m.self_attn.v_proj(m.input_layernorm(h0)).view(1, 2, 8)
    r = h0 + m.self_attn.o_proj(v1.repeat_interleave(2, dim=1).reshape(1, 32))
    x = m.post_attention_layernorm(r)
    expected = r + m.mlp.down_proj(torch.nn.functional.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))
    torch.testing.assert_close(out, expected)
    assert [s[0] for s in seen] == [0, 1]
    assert all(s[1] == (1, 4, 8) and s[2] == (1, 2, 8) for s in seen)
