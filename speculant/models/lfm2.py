"""LFM2 (Liquid AI, transformers `Lfm2ForCausalLM`): gated short-convolution layers and GQA
attention layers (q/k RMSNorm, full RoPE), each followed by a SwiGLU MLP.

A conv layer's state is the window of its last `conv_L_cache - 1` gated inputs (B * x);
attention layers use the paged KV cache. Weights keep their Hugging Face names
(`model.layers.{i}.conv.in_proj.weight`, ...); the final norm is `model.embedding_norm`.
"""
from __future__ import annotations

import torch

from speculant.models.hybrid_config import HybridConfig
from speculant.models.hybrid_layers import Attention, ShortConv, SwiGLU
from speculant.models.hybrid_model import HybridLayer, HybridModel


class Lfm2Model(HybridModel):
    def __init__(self, config: HybridConfig, weights: dict, device="cpu"):
        if config.architecture != "lfm2":
            raise ValueError(f"Lfm2Model cannot run a {config.architecture!r} model")
        dev = torch.device(device)

        def w(name):
            return weights[name].to(dev, torch.float32)

        kv_index = {layer: n for n, layer in enumerate(config.attention_layers)}
        layers = [self._layer(config, weights, w, i, kv_index.get(i))
                  for i in range(config.num_layers)]
        embed = w("model.embed_tokens.weight")
        lm_head = (embed if config.tie_word_embeddings or "lm_head.weight" not in weights
                   else w("lm_head.weight"))
        super().__init__(config, weights, layers, embed, w("model.embedding_norm.weight"),
                         lm_head, dev)

    @staticmethod
    def _layer(c: HybridConfig, weights: dict, w, i: int, kv_index: int | None) -> HybridLayer:
        p = f"model.layers.{i}."

        def opt(name):
            return w(p + name) if p + name in weights else None

        if c.layer_kinds[i] == "attention":
            a = p + "self_attn."
            mixer = Attention(
                {"q": w(a + "q_proj.weight"), "k": w(a + "k_proj.weight"),
                 "v": w(a + "v_proj.weight"), "o": w(a + "out_proj.weight"),
                 "q_norm": w(a + "q_layernorm.weight"), "k_norm": w(a + "k_layernorm.weight")},
                kv_index, c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)
        else:
            mixer = ShortConv(
                {"in_proj": w(p + "conv.in_proj.weight"), "out_proj": w(p + "conv.out_proj.weight"),
                 "in_bias": opt("conv.in_proj.bias"), "out_bias": opt("conv.out_proj.bias"),
                 "conv": w(p + "conv.conv.weight").flatten(1),  # [hidden, 1, K] -> [hidden, K]
                 "conv_bias": opt("conv.conv.bias")}, i)
        f = p + "feed_forward."
        mlp = SwiGLU(w(f + "w1.weight"), w(f + "w3.weight"), w(f + "w2.weight"))
        return HybridLayer(w(p + "operator_norm.weight"), mixer, w(p + "ffn_norm.weight"), mlp)
