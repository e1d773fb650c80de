"""The gated-DeltaNet hybrid of Qwen3-Next (transformers `Qwen3NextForCausalLM`): linear-attention
layers (gated DeltaNet: a causal conv window over q|k|v and a recurrent state per value head) and
gated full-attention layers (q/k RMSNorm, partial RoPE, a sigmoid gate on the output), each
followed by a dense SwiGLU MLP or a sparse MoE with a shared expert.

Weights keep their Hugging Face names. Two layouts are regrouped once at load so the forward
splits contiguous blocks: `in_proj_qkvz` stores q|k|v|z per key-head group (-> all q, all k,
all v, all z) and `q_proj` stores query|gate per head (-> all queries, all gates). Norm weights
are stored as offsets from 1 (`(1 + w) * x`) and are folded to `1 + w`; the DeltaNet output
norm is not. Experts load from per-expert matrices (`mlp.experts.{e}.gate_proj.weight`) or the
fused 3-D tensors transformers >= 5 can write (`mlp.experts.gate_up_proj`).
"""
from __future__ import annotations

import torch

from speculant.models.hybrid_config import HybridConfig
from speculant.models.hybrid_layers import Attention, GatedDeltaNet, SparseMoe, SwiGLU
from speculant.models.hybrid_model import HybridLayer, HybridModel


class Qwen3NextModel(HybridModel):
    def __init__(self, config: HybridConfig, weights: dict, device="cpu"):
        if config.architecture != "qwen3_next":
            raise ValueError(f"Qwen3NextModel cannot run a {config.architecture!r} model")
        dev = torch.device(device)

        def w(name):
            return weights[name].to(dev, torch.float32)

        def norm(name):  # stored as an offset from 1
            return w(name) + config.norm_offset

        kv_index = {layer: n for n, layer in enumerate(config.attention_layers)}
        layers = [_layer(config, weights, w, norm, i, kv_index.get(i))
                  for i in range(config.num_layers)]
        embed = w("model.embed_tokens.weight")
        lm_head = (embed if config.tie_word_embeddings or "lm_head.weight" not in weights
                   else w("lm_head.weight"))
        super().__init__(config, weights, layers, embed, norm("model.norm.weight"), lm_head, dev)


def _layer(c: HybridConfig, weights: dict, w, norm, i: int, kv_index: int | None) -> HybridLayer:
    p = f"model.layers.{i}."
    if c.layer_kinds[i] == "attention":
        mixer = _attention(c, w, norm, p + "self_attn.", kv_index)
    else:
        mixer = _deltanet(c, w, p + "linear_attn.", i)
    mlp = _moe(c, weights, w, p + "mlp.") if i in c.moe_layers else _swiglu(w, p + "mlp.")
    return HybridLayer(norm(p + "input_layernorm.weight"), mixer,
                       norm(p + "post_attention_layernorm.weight"), mlp)


def _attention(c: HybridConfig, w, norm, a: str, kv_index: int) -> Attention:
    # q_proj rows: per head, head_dim query rows then head_dim gate rows
    q_gate = w(a + "q_proj.weight").view(c.num_heads, 2, c.head_dim, c.hidden_size)
    return Attention(
        {"q": q_gate[:, 0].reshape(-1, c.hidden_size), "gate": q_gate[:, 1].reshape(-1, c.hidden_size),
         "k": w(a + "k_proj.weight"), "v": w(a + "v_proj.weight"), "o": w(a + "o_proj.weight"),
         "q_norm": norm(a + "q_norm.weight"), "k_norm": norm(a + "k_norm.weight")},
        kv_index, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)


def _deltanet(c: HybridConfig, w, a: str, layer: int) -> GatedDeltaNet:
    hk, dk, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_value_head_dim
    per_group = c.linear_num_value_heads // hk  # value heads served by each key head
    hidden = c.hidden_size
    q, k, v, z = w(a + "in_proj_qkvz.weight").view(hk, -1, hidden).split(
        [dk, dk, per_group * dv, per_group * dv], dim=1)
    b, a_ = w(a + "in_proj_ba.weight").view(hk, 2 * per_group, hidden).split(per_group, dim=1)
    return GatedDeltaNet(
        {"qkvz": torch.cat([t.reshape(-1, hidden) for t in (q, k, v, z)]),
         "ba": torch.cat([b.reshape(-1, hidden), a_.reshape(-1, hidden)]),
         "conv": w(a + "conv1d.weight").flatten(1), "A_log": w(a + "A_log"),
         "dt_bias": w(a + "dt_bias"), "norm": w(a + "norm.weight"),
         "out_proj": w(a + "out_proj.weight")},
        layer, hk, c.linear_num_value_heads, dk, dv, c.rms_norm_eps)


def _swiglu(w, m: str) -> SwiGLU:
    return SwiGLU(w(m + "gate_proj.weight"), w(m + "up_proj.weight"), w(m + "down_proj.weight"))


def _moe(c: HybridConfig, weights: dict, w, m: str) -> SparseMoe:
    if m + "experts.gate_up_proj" in weights:  # fused: [E, 2 * I, hidden], [E, hidden, I]
        gate_up, down = w(m + "experts.gate_up_proj"), w(m + "experts.down_proj")
        experts = [SwiGLU(*gate_up[e].chunk(2, dim=0), down[e]) for e in range(c.num_experts)]
    else:
        experts = [_swiglu(w, f"{m}experts.{e}.") for e in range(c.num_experts)]
    return SparseMoe(w(m + "gate.weight"), experts, c.num_experts_per_tok, c.norm_topk_prob,
                     _swiglu(w, m + "shared_expert."), w(m + "shared_expert_gate.weight"))
