"""Drafter heads run with packed low-bit weights at inference.

A one-layer head drafting for a 135M target reads ~20 MB of fp32 weights per forward (its
projections, MLP and draft LM head); at one or two rows per sequence that is memory-bound, and
was measured at ~4 ms per engine step on 1 thread, a third of the target's own step. Packed
Q8_0 weights (the target's native kernels) read a quarter of that. Drafts are verified by the
target, so the head's rounding changes speed, never the output.
"""
from __future__ import annotations

import torch
from torch import nn

from speculant.kernels import PackedLinear, native_available

HEAD_WEIGHTS = ("float32", "q8_0")


class PackedLinearModule(nn.Module):
    """An `nn.Linear` (no bias) whose weight lives packed: same call, [..., in] -> [..., out]."""

    def __init__(self, linear: nn.Linear, qtype: str):
        super().__init__()
        self.packed = PackedLinear.from_float(linear.weight.detach().float(), qtype.upper())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x.float().contiguous())


def pack_linears(module: nn.Module, qtype: str) -> int:
    """Replace every bias-free `nn.Linear` below `module` whose input width is a multiple of
    the 32-weight block by its packed form; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and child.bias is None and child.in_features % 32 == 0:
            setattr(module, name, PackedLinearModule(child, qtype))
            count += 1
        else:
            count += pack_linears(child, qtype)
    return count


def resolve_head_weights(weights: str, device: str) -> str:
    """'auto' -> q8_0 where the native kernels run (CPU), else float32."""
    if weights not in ("auto", *HEAD_WEIGHTS):
        raise ValueError(f"head weights must be auto or one of {HEAD_WEIGHTS}, got {weights!r}")
    if weights != "auto":
        return weights
    return "q8_0" if str(device).startswith("cpu") and native_available() else "float32"
