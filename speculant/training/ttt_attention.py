"""Attention of EAGLE-3's training-time test: k unrolled draft steps over one packed row.

At unrolled step j the head's query for row index p stands for the token drafted j steps after
position p. At inference that draft token sees the target's context (step-0 keys at indices
<= p of its own sequence) and the keys the head itself wrote for positions p+1..p+j of the same
draft chain, which training stores at index p of steps 1..j (the "diagonal"). SpecForge
(`cache_hidden`) and the EAGLE repository compute exactly this; `ttt_attention` does it without
materialising a [T, T * (j + 1)] mask: one causal score matrix plus j diagonal score columns.
"""
from __future__ import annotations

import torch


def row_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    # doc_ids [T] sequence index of each row of a packed row -> [T, T] bool: causal, same sequence
    num_tokens = doc_ids.shape[0]
    causal = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=doc_ids.device).tril()
    return causal & (doc_ids[:, None] == doc_ids[None, :])


def ttt_attention(
    q: torch.Tensor,  # [T, H, hd] step j's rotated queries
    keys: list[torch.Tensor],  # j + 1 tensors [T, KV, hd]: rotated keys of steps 0..j
    values: list[torch.Tensor],  # j + 1 tensors [T, KV, hd]
    mask: torch.Tensor,  # [T, T] bool from row_mask
) -> torch.Tensor:
    """Step j's attention output [T, H * hd] (softmax over the causal step-0 keys and the
    diagonal keys of steps 1..j, jointly)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // keys[0].shape[1]  # grouped-query attention: kv head h // group

    def expand(x):  # [T, KV, hd] -> [H, T, hd]
        return x.repeat_interleave(group, dim=1).transpose(0, 1)

    qh = q.transpose(0, 1) * head_dim ** -0.5  # [H, T, hd]
    scores0 = (qh @ expand(keys[0]).transpose(1, 2)).masked_fill(~mask, float("-inf"))  # [H, T, T]
    diag = [(qh * expand(k)).sum(-1, keepdim=True) for k in keys[1:]]  # j x [H, T, 1]
    probs = torch.softmax(torch.cat([scores0, *diag], dim=-1), dim=-1)  # [H, T, T + j]
    out = probs[..., :num_tokens] @ expand(values[0])  # [H, T, hd]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., num_tokens + i:num_tokens + i + 1] * expand(v)
    return out.transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
