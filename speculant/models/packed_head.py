"""Drafter heads run with packed low-bit weights at inference.

A one-layer head drafting for a 135M target reads ~20 MB of fp32 weights per forward (its
projections, MLP and draft LM head); at one or two rows per sequence that is memory-bound, and
was measured at ~4 ms per engine step on 1 thread, a third of the target's own step. Packed
weights on the target's native kernels read a quarter (Q8_0) or an eighth (Q4_1) of that.
The target's own step streams ~145 MB of weights, so the head's are read from DRAM at every
draft call, not from cache: a 12,288-row LM head took 0.45 ms in Q8_0 (0.12 ms back to back)
and 0.21 ms in 4 bits. Q4_1 is the default on the CPU: measured against Q8_0 in one process,
prompts alternating (AMD EPYC, 2 threads, 12 prompts, 256 tokens, c=1), eagle3 went from
1.11-1.13x to 1.20-1.21x plain on mt_bench and 1.08x to 1.18x on math_reasoning, with as many
tokens accepted per step (cheaper calls also let the chain draft further). Drafts are verified
by the target, so the head's rounding changes speed, never the output.
"""
from __future__ import annotations

import torch
from torch import nn

from speculant.kernels import PackedLinear, native_available
from speculant.kernels.ggml_blocks import GGMLBlocks
from speculant.models.head_quant import load_packed, packable_linears, replace_linear

HEAD_WEIGHTS = ("float32", "q8_0", "q4_1", "q4_0")
DEFAULT_CPU_HEAD_WEIGHTS = "q4_1"


class PackedLinearModule(nn.Module):
    """An `nn.Linear` (no bias) whose weight lives packed: same call, [..., in] -> [..., out].
    `blocks`: its weight already quantized (a head's GPTQ blocks, `head_quant.py`); else the
    float weight is rounded by ggml's reference quantizer."""

    def __init__(self, linear: nn.Linear, qtype: str, blocks: GGMLBlocks | None = None):
        super().__init__()
        self.packed = (PackedLinear.from_blocks(blocks) if blocks is not None else
                       PackedLinear.from_float(linear.weight.detach().float(), qtype.upper()))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x.float().contiguous())


def pack_linears(module: nn.Module, qtype: str,
                 blocks: dict[str, GGMLBlocks] | None = None) -> int:
    """Replace every bias-free `nn.Linear` below `module` whose input width is a multiple of
    the 32-weight block by its packed form, from `blocks` (keyed by the weight's state-dict
    key, `head_quant.load_packed`) where given; returns how many were replaced."""
    count = 0
    for key, linear in packable_linears(module).items():
        replace_linear(module, key, PackedLinearModule(linear, qtype, (blocks or {}).get(key)))
        count += 1
    return count


def load_head_blocks(module: nn.Module, head_dir: str, qtype: str) -> dict[str, GGMLBlocks]:
    """The GPTQ blocks shipped beside the head in `head_dir` for `qtype`, checked against
    `module`'s linears; empty when there are none."""
    shapes = {key: (m.out_features, m.in_features)
              for key, m in packable_linears(module).items()}
    return load_packed(head_dir, qtype.upper(), shapes) or {}


def packed_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of every packed linear below `module` (data, scales, mins)."""
    return [t for m in module.modules() if isinstance(m, PackedLinearModule)
            for t in (m.packed.data, m.packed.scales, m.packed.mins) if isinstance(t, torch.Tensor)]


def resolve_head_weights(weights: str, device: str) -> str:
    """'auto' -> DEFAULT_CPU_HEAD_WEIGHTS where the native kernels run (CPU), else float32."""
    if weights not in ("auto", *HEAD_WEIGHTS):
        raise ValueError(f"head weights must be auto or one of {HEAD_WEIGHTS}, got {weights!r}")
    if weights != "auto":
        return weights
    if str(device).startswith("cpu") and native_available():
        return DEFAULT_CPU_HEAD_WEIGHTS
    return "float32"
