"""The Llama-family transformer (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache.

One `forward` runs a ragged batch: tokens of many sequences at their own positions. Weights are
`PackedLinear`s (compact, batch-invariant kernels); activations are fp32. There is no global
forward state: everything a forward needs arrives in its `ForwardBatch`, so a target and a draft
model live side by side in one process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from speculant.engine.forward_batch import ForwardBatch
from speculant.kernels import (PackedLinear, add_rms_norm, native_available, paged_attention,
                               rms_norm, rope_cos_sin, rope_write_kv, silu_mul)
from speculant.kernels.decoder import RegisteredStack, decoder_stack
from speculant.kernels.huge_pages import move_to_huge_pages
from speculant.kernels.kv_layout import native_block_size
from speculant.engine.kv_cache import KVCache
from speculant.models.config import ModelConfig


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [R, vocab_size] fp32, rows = batch.logits_indices
    # layer -> [H, hidden] its output (pre-norm) at rows batch.hidden_rows (all T rows if None)
    hidden_states: dict[int, torch.Tensor]
    # [R] int64 each logits row's argmax, when batch.greedy_picks asked and the native LM head
    # ran (else None: the caller takes the argmax of `logits`)
    argmax: torch.Tensor | None = None


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


# How a forward runs its layers: "stack" = one native call for all layers (csrc/decoder.cpp),
# "ops" = the same native kernels called one by one from Python, "torch" = the pure-PyTorch
# reference maths; "auto" = "stack" where the native kernels run (CPU), else "torch".
PATHS = ("auto", "stack", "ops", "torch")


class Model:
    def __init__(self, config: ModelConfig, weights: dict, device="cpu", *, path: str = "auto"):
        if path not in PATHS:
            raise ValueError(f"unknown model path {path!r}; expected one of {PATHS}")
        self.config = config
        self.device = torch.device(device)
        self.embed = weights["token_embd.weight"].to(self.device)
        self.lm_head = (self.embed if config.tie_word_embeddings
                        else weights["output.weight"].to(self.device))
        self.final_norm = weights["output_norm.weight"].to(self.device, torch.float32).contiguous()
        self.layers = [self._layer(weights, i) for i in range(config.num_layers)]
        # the norm that follows each layer's MLP: the next layer's attention norm, or the final one
        self.norms_after = [layer.attn_norm for layer in self.layers[1:]] + [self.final_norm]
        cos, sin = rope_cos_sin(config.head_dim, config.rope_theta,
                                config.max_position_embeddings, self.device)
        self.rope_cos, self.rope_sin = cos, sin  # [max_positions, head_dim]
        self.attn_scale = config.head_dim ** -0.5
        native = self.device.type == "cpu" and native_available()
        if path == "auto":
            path = "stack" if native else "torch"
        if path in ("stack", "ops") and not native:
            raise RuntimeError(f"model path {path!r} needs the native kernels on the CPU")
        self.path = path
        self._native = None if path != "torch" else False  # the kernels' `native=` argument
        # the packed weights on 2 MB pages (kernels/huge_pages.py), before the stack names them
        self.huge_page_bytes = move_to_huge_pages(self._packed_tensors()) \
            if self.device.type == "cpu" else 0
        self._stack = RegisteredStack(self.layers) if path == "stack" else None

    def _packed_mats(self) -> list:
        """Every packed matrix: the embedding, the LM head (when untied), the layers' linears."""
        mats = [self.embed] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            mats += [layer.qkv, layer.attn_output, layer.gate_up, layer.down]
        return mats

    def _packed_tensors(self) -> list[torch.Tensor]:
        return [t for m in self._packed_mats()
                for t in (getattr(m, name, None) for name in ("data", "scales", "mins"))
                if isinstance(t, torch.Tensor)]

    def _layer(self, w: dict, i: int) -> LayerWeights:
        p = f"blk.{i}."
        dev = self.device

        def vec(name):  # the fused kernels take contiguous fp32 vectors
            t = w.get(p + name)
            return None if t is None else t.to(dev, torch.float32).contiguous()

        biases = [w.get(p + f"attn_{x}.bias") for x in "qkv"]
        qkv_bias = (torch.cat(biases).to(dev, torch.float32)
                    if all(b is not None for b in biases) else None)
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
        return sum(m.nbytes for m in self._packed_mats())

    def new_kv_cache(self, num_blocks: int, block_size: int = 16,
                     dtype: torch.dtype = torch.float32) -> KVCache:
        """A paged KV cache for this model; `dtype` float16 halves the cache's memory and the
        bytes attention reads per step (K and V are rounded to fp16 when written)."""
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks, block_size,
                       dtype, self.device)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [T] int64 -> [T, hidden] float32 (dequantized embedding rows)."""
        return self.embed.embed(token_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> ForwardOutput:
        c = self.config
        eps = c.rms_norm_eps
        token_pos = batch.positions_i32()  # paged_attention's index type, cast once
        # the residual stream [T, hidden], updated in place by every layer (hence the clones below)
        h = self.embed.embed(batch.token_ids).contiguous()
        wanted = sorted(set(batch.hidden_layers))
        if self._stack is not None and native_block_size(cache.block_size):
            x, states = decoder_stack(
                h, self._stack, cache.k, cache.v, self.rope_cos, self.rope_sin, batch.positions,
                batch.slot_mapping, batch.block_tables, batch.token_seq, token_pos,
                self.final_norm, wanted, c.num_heads, eps, self.attn_scale, batch.hidden_rows,
                batch.prompt_lens)
            hidden = dict(zip(wanted, states))
        else:
            x, hidden = self._layers(h, batch, cache, token_pos, set(wanted))
        rows = x.index_select(0, batch.logits_indices)  # [R, hidden]
        if batch.greedy_picks:
            logits, argmax = self.lm_head.with_argmax(rows, native=self._native)
            return ForwardOutput(logits=logits, hidden_states=hidden, argmax=argmax)
        return ForwardOutput(logits=self.lm_head(rows, native=self._native), hidden_states=hidden)

    def _layers(self, h, batch: ForwardBatch, cache: KVCache, token_pos, wanted: set[int]):
        # The layers op by op (what decoder_stack does natively): returns the final-normed
        # hidden states [T, hidden] and the wanted layers' outputs.
        c, eps, native = self.config, self.config.rms_norm_eps, self._native
        num_tokens = h.shape[0]
        x = rms_norm(h, self.layers[0].attn_norm, eps, native=native)  # [T, hidden]
        hidden: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = cache.k[i], cache.v[i]
            # 1) attention: q, k, v rotated; k, v written at their slots first, then attended over
            q = rope_write_kv(layer.qkv(x, native=native), layer.qkv_bias, layer.q_norm,
                              layer.k_norm, eps, self.rope_cos, self.rope_sin, batch.positions,
                              k_cache, v_cache, batch.slot_mapping, c.num_heads,
                              native=native)  # [T, heads, head_dim]
            attn = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.token_seq,
                                   token_pos, self.attn_scale, native=native,
                                   prompt_lens=batch.prompt_lens)
            o = layer.attn_output(attn.view(num_tokens, c.q_size), native=native)
            x = add_rms_norm(h, o, layer.ffn_norm, eps, native=native)
            # 2) MLP, its residual add fused with the next norm (next layer's, or the final one)
            down = layer.down(silu_mul(layer.gate_up(x, native=native), native=native),
                              native=native)
            x = add_rms_norm(h, down, self.norms_after[i], eps, native=native)
            if i in wanted:
                rows = batch.hidden_rows  # h changes in place: copies, of the rows wanted only
                hidden[i] = h.clone() if rows is None else h.index_select(0, rows)
        return x, hidden
