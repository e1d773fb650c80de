"""Row-wise operators of a decoder layer: RMSNorm (optionally fused with the residual add) and the
SiLU-gated product of the MLP.

Each runs natively (csrc/rowwise.cpp) on CPU tensors when `native_available()`, row by row with
one fixed instruction sequence, so a row's result is bit-identical whatever else is in the batch.
Otherwise, or with `native=False`, the PyTorch reference runs: the same formulas (HF's
LlamaRMSNorm in fp32, `F.silu(gate) * up`), which agree with the native path to ~1e-7 relative
(the sums of squares and exp are computed in a different order / with a different polynomial).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from speculant.kernels.native import native_available


def use_native(native: bool | None, *tensors: torch.Tensor) -> bool:
    """Whether to run the native kernel: `native=None` picks it when every tensor is on the CPU and
    the kernels are available; True insists (and raises if it can't), False forces PyTorch."""
    if native is False:
        return False
    ok = all(t.is_cpu for t in tensors) and native_available()
    if native and not ok:
        raise RuntimeError("native kernels requested but unavailable (SPECULANT_NATIVE=0, CPU "
                           "without AVX2/FMA/F16C, build failure, or tensors not on the CPU)")
    return ok


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             native: bool | None = None) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim. x [..., D] float32; weight [D]."""
    if use_native(native, x) and x.dim() == 2 and x.is_contiguous():
        return torch.ops.speculant.rms_norm.default(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 native: bool | None = None) -> torch.Tensor:
    """The residual add and the next norm in one pass: h += delta (in place), returns
    rms_norm(h). h, delta [T, D] float32 contiguous; weight [D]."""
    if use_native(native, h):
        return torch.ops.speculant.add_rms_norm.default(h, delta, weight, eps)
    h.add_(delta)
    return rms_norm_reference(h, weight, eps)


def silu_mul(gate_up: torch.Tensor, *, native: bool | None = None) -> torch.Tensor:
    """gate_up [T, 2F] (gate | up, as the fused projection returns them) -> silu(gate) * up
    [T, F]."""
    if use_native(native, gate_up):
        return torch.ops.speculant.silu_mul.default(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x [..., D]; HF's LlamaRMSNorm in fp32, in its order of operations
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))
