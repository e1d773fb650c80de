"""The Llama-family transformer (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

One `forward` runs a ragged batch: tokens of many sequences at their own positions. Weights are
`PackedLinear`s (compact, batch-invariant kernels); activations are fp32. There is no global
forward state: everything a forward needs arrives in its `ForwardBatch`, so a target and a draft
model live side by side in one process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculant.forward_batch import ForwardBatch
from speculant.kernels import PackedLinear, paged_attention
from speculant.kv_cache import KVCache
from speculant.model_config import ModelConfig


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab_size] fp32, rows = batch.logits_indices
    hidden_states: dict[int, torch.Tensor]  # layer -> [T, hidden] output of that layer (pre-norm)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: PackedLinear  # [q_size + 2 * kv_size, hidden], rows q | k | v
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim]
    attn_output: PackedLinear  # [hidden, q_size]
    ffn_norm: torch.Tensor  # [hidden]
    gate_up: PackedLinear  # [2 * intermediate, hidden], rows gate | up
    down: PackedLinear  # [hidden, intermediate]


def rope_cos_sin(head_dim: int, theta: float, max_positions: int, device="cpu"):
    """NeoX-style rotary tables (as HF computes them, in fp32). Returns two [max_positions, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                                .float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, head_dim]; cos, sin [T, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., dim]; the same formula (and order of operations) as HF's LlamaRMSNorm.
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


class Model:
    def __init__(self, config: ModelConfig, weights: dict, device="cpu"):
        self.config = config
        self.device = torch.device(device)
        self.embed = weights["token_embd.weight"].to(self.device)
        self.lm_head = (self.embed if config.tie_word_embeddings
                        else weights["output.weight"].to(self.device))
        self.final_norm = weights["output_norm.weight"].to(self.device)
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        cos, sin = rope_cos_sin(config.head_dim, config.rope_theta,
                                config.max_position_embeddings, self.device)
        self.rope_cos, self.rope_sin = cos, sin  # [max_positions, head_dim]
        self.attn_scale = config.head_dim ** -0.5

    def _layer(self, w: dict, i: int) -> LayerWeights:
        p = f"blk.{i}."
        dev = self.device

        def vec(name):
            t = w.get(p + name)
            return None if t is None else t.to(dev)

        biases = [w.get(p + f"attn_{x}.bias") for x in "qkv"]
        qkv_bias = torch.cat(biases).to(dev) if all(b is not None for b in biases) else None
        return LayerWeights(
            attn_norm=vec("attn_norm.weight"),
            qkv=PackedLinear.concat([w[p + f"attn_{x}.weight"] for x in "qkv"]).to(dev),
            qkv_bias=qkv_bias,
            q_norm=vec("attn_q_norm.weight"),
            k_norm=vec("attn_k_norm.weight"),
            attn_output=w[p + "attn_output.weight"].to(dev),
            ffn_norm=vec("ffn_norm.weight"),
            gate_up=PackedLinear.concat([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]).to(dev),
            down=w[p + "ffn_down.weight"].to(dev),
        )

    @property
    def nbytes(self) -> int:
        mats = [self.embed] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            mats += [layer.qkv, layer.attn_output, layer.gate_up, layer.down]
        return sum(m.nbytes for m in mats)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size,
                       torch.float32, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        c = self.config
        h = self.embed.embed(batch.token_ids)  # [T, hidden]
        cos = self.rope_cos[batch.positions].unsqueeze(1)  # [T, 1, head_dim]
        sin = self.rope_sin[batch.positions].unsqueeze(1)
        token_pos = batch.positions.to(torch.int32)
        wanted = set(batch.hidden_layers)
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = self._attention_block(h, layer, i, batch, cache, cos, sin, token_pos)
            h = self._mlp_block(h, layer)
            if i in wanted:
                hidden[i] = h
        last = h.index_select(0, batch.logits_indices)  # [R, hidden]
        logits = self.lm_head(rms_norm(last, self.final_norm, c.rms_norm_eps))
        return ForwardOutput(logits=logits, hidden_states=hidden)

    def _attention_block(self, h, layer: LayerWeights, i: int, batch: ForwardBatch,
                         cache: KVCache, cos, sin, token_pos) -> torch.Tensor:
        c = self.config
        num_tokens = h.shape[0]
        qkv = layer.qkv(rms_norm(h, layer.attn_norm, c.rms_norm_eps))  # [T, q + 2 kv]
        if layer.qkv_bias is not None:
            qkv = qkv + layer.qkv_bias
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q = rms_norm(q, layer.q_norm, c.rms_norm_eps)
            k = rms_norm(k, layer.k_norm, c.rms_norm_eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # Write this batch's K/V at their absolute slots first, then attend over the cache.
        k_flat = cache.k[i].view(-1, c.num_kv_heads, c.head_dim)
        v_flat = cache.v[i].view(-1, c.num_kv_heads, c.head_dim)
        k_flat.index_copy_(0, batch.slot_mapping, k)
        v_flat.index_copy_(0, batch.slot_mapping, v.reshape(num_tokens, c.num_kv_heads, c.head_dim))
        attn = paged_attention(q.contiguous(), cache.k[i], cache.v[i], batch.block_tables,
                               batch.token_seq, token_pos, self.attn_scale)  # [T, heads, head_dim]
        return h + layer.attn_output(attn.reshape(num_tokens, c.q_size))

    def _mlp_block(self, h, layer: LayerWeights) -> torch.Tensor:
        c = self.config
        gate_up = layer.gate_up(rms_norm(h, layer.ffn_norm, c.rms_norm_eps))  # [T, 2 * ffn]
        gate, up = gate_up.split([c.intermediate_size, c.intermediate_size], dim=-1)
        return h + layer.down((F.silu(gate) * up).contiguous())
