"""The layers hybrid models are built from, in plain PyTorch (fp32): token mixers (attention
over the paged KV cache, LFM2's gated short convolution, the gated DeltaNet) and MLPs (SwiGLU,
Qwen3-Next's sparse MoE with a shared expert).

A mixer is called as `mixer(x, run)`: x [T, hidden] the normed residual stream of the whole ragged
batch, `run` what the forward shares (`ForwardRun`: the batch, the caches, RoPE rows, the state
steps being kept); an MLP as `mlp(x)`. Stateful mixers walk the batch chunk by chunk, each chunk starting from its
sequence's slot in the state cache and leaving its final state there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculant.engine.forward_batch import ForwardBatch
from speculant.engine.kv_cache import KVCache
from speculant.engine.state_cache import StateBatch, StepStates
from speculant.kernels import paged_attention
from speculant.kernels.kv_layout import write_kv
from speculant.models.recurrence import causal_conv, conv_windows, gated_delta_rule, l2_normalize


@dataclass(slots=True)
class ForwardRun:
    """What every layer of one forward reads: no global state, two models never collide."""

    batch: ForwardBatch
    cache: KVCache
    states: StateBatch
    rope_cos: torch.Tensor  # [T, rotary_dim]
    rope_sin: torch.Tensor  # [T, rotary_dim]
    token_pos: torch.Tensor  # [T] int32 (paged_attention's index type)
    steps: dict[int, StepStates]  # seq_id -> states after every row, for keep_steps chunks

    def chunks(self):
        """(chunk index, token rows, state slot) of every chunk, in batch order."""
        cu = self.batch.cu_num_tokens
        for s, slot in enumerate(self.states.slots):
            yield s, slice(cu[s], cu[s + 1]), slot

    def keep(self, s: int) -> StepStates | None:
        """Where chunk s's per-row states go, if it keeps them."""
        if not self.states.keep_steps[s]:
            return None
        return self.steps.setdefault(self.states.seq_ids[s], StepStates({}, {}))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., D]; transformers' order of operations in fp32
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float):
    """cos, sin [T, rotary_dim] of NeoX-style RoPE (halves rotated), as transformers builds them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]: rotate the first rotary_dim features, pass the rest through."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    half = d // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([rot, rest], dim=-1)


class Attention:
    """GQA attention over the paged KV cache with per-head q/k RMSNorm, partial RoPE and (Qwen3-
    Next) a sigmoid output gate per feature."""

    def __init__(self, w: dict, kv_index: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float):
        self.q, self.gate = w["q"], w.get("gate")  # [H * hd, hidden] each
        self.k, self.v, self.o = w["k"], w["v"], w["o"]
        self.q_norm, self.k_norm = w["q_norm"], w["k_norm"]  # [hd]
        self.kv_index = kv_index  # this layer's place in the KV cache (attention layers only)
        self.num_heads, self.num_kv_heads, self.head_dim, self.eps = (
            num_heads, num_kv_heads, head_dim, eps)

    def __call__(self, x: torch.Tensor, run: ForwardRun) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = rms_norm(F.linear(x, self.q).view(num_tokens, self.num_heads, self.head_dim),
                     self.q_norm, self.eps)
        k = rms_norm(F.linear(x, self.k).view(num_tokens, self.num_kv_heads, self.head_dim),
                     self.k_norm, self.eps)
        v = F.linear(x, self.v).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, run.rope_cos, run.rope_sin).contiguous()
        k = apply_rope(k, run.rope_cos, run.rope_sin)
        k_cache, v_cache = run.cache.k[self.kv_index], run.cache.v[self.kv_index]
        # written first, then attended over: each token sees its own K/V and its chunk's earlier ones
        write_kv(k_cache, v_cache, run.batch.slot_mapping, k, v)
        b = run.batch
        attn = paged_attention(q, k_cache, v_cache, b.block_tables, b.token_seq, run.token_pos,
                               self.head_dim ** -0.5,
                               prompt_lens=b.prompt_lens).reshape(num_tokens, -1)  # [T, H * hd]
        if self.gate is not None:
            attn = attn * torch.sigmoid(F.linear(x, self.gate))
        return F.linear(attn, self.o)


class ShortConv:
    """LFM2's gated short convolution: B, C, x = in_proj(h); y = out_proj(C * conv(B * x))."""

    def __init__(self, w: dict, layer: int):
        self.in_proj, self.out_proj = w["in_proj"], w["out_proj"]  # [3 * hidden, hidden], [hidden]^2
        self.in_bias, self.out_bias = w.get("in_bias"), w.get("out_bias")
        self.conv, self.conv_bias = w["conv"], w.get("conv_bias")  # [hidden, K], [hidden]
        self.layer = layer

    def __call__(self, x: torch.Tensor, run: ForwardRun) -> torch.Tensor:
        b, c, u = F.linear(x, self.in_proj, self.in_bias).chunk(3, dim=-1)  # [T, hidden] each
        mixed = conv_layer(b * u, self.layer, self.conv, self.conv_bias, run)
        return F.linear(c * mixed, self.out_proj, self.out_bias)


def conv_layer(u: torch.Tensor, layer: int, weight: torch.Tensor, bias: torch.Tensor | None,
               run: ForwardRun) -> torch.Tensor:
    """The causal conv of every chunk from its sequence's window; windows updated in place."""
    windows = run.states.cache.conv[layer]  # [num_slots, C, W]
    width = windows.shape[-1]
    out = torch.empty_like(u)  # [T, C]
    for s, rows, slot in run.chunks():
        out[rows], padded = causal_conv(u[rows], windows[slot], weight, bias)
        windows[slot].copy_(padded[:, -width:])
        keep = run.keep(s)
        if keep is not None:
            keep.conv[layer] = conv_windows(padded, width)  # [n, C, W] views of padded
    return out


class GatedDeltaNet:
    """Qwen3-Next's linear attention: q|k|v through a causal conv + SiLU, the gated delta rule
    per value head, an RMSNorm gated by SiLU(z), out_proj. Key heads serve
    num_v_heads / num_k_heads consecutive value heads each."""

    def __init__(self, w: dict, layer: int, num_k_heads: int, num_v_heads: int, k_dim: int,
                 v_dim: int, eps: float):
        self.qkvz, self.ba = w["qkvz"], w["ba"]  # rows q | k | v | z and b | a (regrouped at load)
        self.conv, self.a_log, self.dt_bias = w["conv"], w["A_log"], w["dt_bias"]
        self.norm, self.out_proj = w["norm"], w["out_proj"]
        self.layer = layer
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim, self.eps = (
            num_k_heads, num_v_heads, k_dim, v_dim, eps)

    def __call__(self, x: torch.Tensor, run: ForwardRun) -> torch.Tensor:
        num_tokens = x.shape[0]
        key_size, value_size = self.num_k_heads * self.k_dim, self.num_v_heads * self.v_dim
        qkv, z = F.linear(x, self.qkvz).split([2 * key_size + value_size, value_size], dim=-1)
        b, a = F.linear(x, self.ba).chunk(2, dim=-1)  # [T, Hv] each
        qkv = F.silu(conv_layer(qkv, self.layer, self.conv, None, run))
        q, k, v = qkv.split([key_size, key_size, value_size], dim=-1)
        q, k = self._heads(q), self._heads(k)
        q = l2_normalize(q) * self.k_dim ** -0.5
        k = l2_normalize(k)
        v = v.view(num_tokens, self.num_v_heads, self.v_dim)
        g = -self.a_log.exp() * F.softplus(a + self.dt_bias)  # [T, Hv] log decay
        out = self._delta_rule(q, k, v, g, torch.sigmoid(b), run)  # [T, Hv, dv]
        z = z.view(num_tokens, self.num_v_heads, self.v_dim)
        out = rms_norm(out, self.norm, self.eps) * F.silu(z)
        return F.linear(out.reshape(num_tokens, -1), self.out_proj)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        # [T, Hk * dk] -> [T, Hv, dk]: each key head repeated for the value heads it serves
        t = t.view(t.shape[0], self.num_k_heads, self.k_dim)
        return t.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=1)

    def _delta_rule(self, q, k, v, g, beta, run: ForwardRun) -> torch.Tensor:
        states = run.states.cache.recurrent[self.layer]  # [num_slots, Hv, dk, dv]
        out = torch.empty_like(v)
        for s, rows, slot in run.chunks():
            keep = run.keep(s)
            out[rows], final, steps = gated_delta_rule(
                q[rows], k[rows], v[rows], g[rows], beta[rows], states[slot], keep is not None)
            states[slot].copy_(final)
            if keep is not None:
                keep.recurrent[self.layer] = steps
        return out


class SwiGLU:
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate, self.up, self.down = gate, up, down  # [I, hidden], [I, hidden], [hidden, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, self.gate)) * F.linear(x, self.up), self.down)


class SparseMoe:
    """Top-k routed experts (softmax router, optionally renormalised over the chosen k) plus a
    shared expert scaled by a sigmoid gate (Qwen3-Next)."""

    def __init__(self, router: torch.Tensor, experts: list[SwiGLU], top_k: int, norm_topk: bool,
                 shared: SwiGLU, shared_gate: torch.Tensor):
        self.router, self.experts, self.top_k, self.norm_topk = router, experts, top_k, norm_topk
        self.shared, self.shared_gate = shared, shared_gate  # [num_experts, hidden], [1, hidden]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.router), dim=-1)  # [T, num_experts]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out
