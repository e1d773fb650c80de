"""GPTQ for drafter heads: their linears quantized into GGML blocks against the inputs they see.

At inference a head's linears run packed (`packed_head.py`: Q4_1 on the CPU, an eighth of the
fp32 bytes). Rounding each 32-weight block to its own min/max grid (ggml's reference quantizer)
cost the shipped EAGLE-3 head 0.005 of held-out first-token agreement (mt_bench 0.008) and 0.03
of expected accepted length with 3 drafts (2.413 -> 2.383): ~1% of what it accepts, for nothing
but the rounding. GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers") rounds one input column at a time and moves each column's
rounding error onto the columns not yet rounded, weighted by the inverse of the inputs' Gram
matrix H = X^T X, so the error left in X W^T is what no later column can absorb. Each block's
grid (GGML's: 32 consecutive input columns per output row) is fixed from the weights as they
stand when the block's first column is reached, so the result is plain GGML blocks that the
native kernels run unchanged.

Terms: *gram* H [in, in], summed over calibration rows of a linear's input (the head run on
training data, its unrolled draft steps included); *damping* adds `damp` x mean(diag H) to the
diagonal (GPTQ's 1%), so a direction the data never excites keeps its own rounding.

The blocks are written beside the head (`model.q4_1.safetensors`: per weight, its raw GGML rows
as a GGUF file stores them) and loaded instead of requantizing the float weights when the
drafter runs that block type (`load_packed`).
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from speculant.kernels import ggml_blocks
from speculant.kernels.ggml_blocks import BLOCK_SIZE, GGMLBlocks

PACKED_QTYPES = ("Q4_1", "Q4_0", "Q8_0")
DEFAULT_DAMP = 0.01
COLUMN_BATCH = 128  # columns rounded before their error reaches the rest (a multiple of 32)


def packed_file(head_dir: str, qtype: str) -> str:
    """Where a head's pre-quantized blocks of `qtype` live."""
    return os.path.join(head_dir, f"model.{qtype.lower()}.safetensors")


# ---- the maths --------------------------------------------------------------------------------

def block_grid(w: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, offset) [N] fp32 of one block's grid from its weights w [N, 32], as ggml's
    reference quantizer picks them, rounded to the fp16 the block stores: Q4_1 spans min..max
    in 15 steps (offset = min), Q4_0 puts the value of largest magnitude at -8, Q8_0 the
    largest magnitude at 127 (offset 0 for both)."""
    if qtype == "Q4_1":
        lo = w.amin(dim=-1)
        return ((w.amax(dim=-1) - lo) / 15).half().float(), lo.half().float()
    if qtype == "Q4_0":
        peak = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True))[:, 0]
        return (peak / -8).half().float(), torch.zeros_like(peak)
    return (w.abs().amax(dim=-1) / 127).half().float(), torch.zeros_like(w[:, 0])


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                  qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, w_hat) [N] of one column w [N] on per-row grids: the stored value (0..15 for Q4_*,
    -127..127 for Q8_0) and what it dequantizes to, exactly as `ggml_blocks.dequantize`."""
    inv = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    if qtype == "Q4_1":
        q = torch.round((w - offset) * inv).clamp(0, 15)
        return q, scale * q + offset
    if qtype == "Q4_0":
        q = (torch.round(w * inv) + 8).clamp(0, 15)
        return q, scale * (q - 8)
    q = torch.round(w * inv).clamp(-127, 127)
    return q, scale * q


def inverse_cholesky(gram: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor [in, in] of the damped gram's inverse (GPTQ's Hinv). Columns no
    input reached get a unit diagonal. Damping grows tenfold until the factorisation holds."""
    h = gram.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    mean_diag = float(torch.diagonal(h).mean())
    for attempt in range(6):
        damped = h + (damp * 10 ** attempt) * mean_diag * torch.eye(h.shape[0], dtype=h.dtype)
        lower, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
    raise ValueError("gptq: the inputs' gram matrix is not positive definite even with damping "
                     f"{damp * 1e5:g}")


def gptq_blocks(weight: torch.Tensor, gram: torch.Tensor, qtype: str,
                damp: float = DEFAULT_DAMP) -> GGMLBlocks:
    """GGML blocks of weight [N, K] (K a multiple of 32) rounded by GPTQ against gram [K, K]."""
    if qtype not in PACKED_QTYPES:
        raise ValueError(f"gptq: block type must be one of {PACKED_QTYPES}, got {qtype!r}")
    n, k = weight.shape
    if k % BLOCK_SIZE or tuple(gram.shape) != (k, k):
        raise ValueError(f"gptq: weight [{n}, {k}] needs in_features a multiple of 32 and a "
                         f"[{k}, {k}] gram, got {list(gram.shape)}")
    w = weight.detach().float().clone()  # [N, K], columns still to round carry earlier errors
    w[:, torch.diagonal(gram) == 0] = 0.0
    hinv = inverse_cholesky(gram, damp)  # [K, K] upper
    q = torch.zeros(n, k)
    scales = torch.zeros(n, k // BLOCK_SIZE)
    offsets = torch.zeros(n, k // BLOCK_SIZE)
    for c0 in range(0, k, COLUMN_BATCH):
        c1 = min(c0 + COLUMN_BATCH, k)
        errors = torch.zeros(n, c1 - c0)
        for c in range(c0, c1):
            if c % BLOCK_SIZE == 0:
                b = c // BLOCK_SIZE
                scales[:, b], offsets[:, b] = block_grid(w[:, c:c + BLOCK_SIZE], qtype)
            q[:, c], w_hat = round_to_grid(w[:, c], scales[:, b], offsets[:, b], qtype)
            err = (w[:, c] - w_hat) / hinv[c, c]
            w[:, c:c1] -= err[:, None] * hinv[c, c:c1][None, :]
            errors[:, c - c0] = err
        w[:, c1:] -= errors @ hinv[c0:c1, c1:]
    mins = offsets.half() if qtype == "Q4_1" else None
    return ggml_blocks.from_values(qtype, q.reshape(n, -1, BLOCK_SIZE), scales.half(), mins)


# ---- a head's linears -------------------------------------------------------------------------

def packable_linears(module: nn.Module) -> dict[str, nn.Linear]:
    """The linears `packed_head.pack_linears` packs, by state-dict key of their weight."""
    return {f"{name}.weight": m for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and m.bias is None and m.in_features % BLOCK_SIZE == 0}


def replace_linear(module: nn.Module, key: str, new: nn.Module) -> None:
    """Put `new` where the linear whose weight has state-dict key `key` sits below `module`."""
    parent, _, name = key[:-len(".weight")].rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, name, new)


def input_grams(head: nn.Module, calibrate: Callable[[], None]) -> dict[str, torch.Tensor]:
    """Gram matrices [in, in] (float64) of every packable linear's inputs while `calibrate()`
    runs the head on calibration data."""
    grams: dict[str, torch.Tensor] = {}

    def hook(key):
        def add(_module, inputs):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()  # [rows, in]
            grams[key] = grams[key] + x.T @ x if key in grams else x.T @ x
        return add

    handles = [m.register_forward_pre_hook(hook(key))
               for key, m in packable_linears(head).items()]
    try:
        with torch.no_grad():
            calibrate()
    finally:
        for h in handles:
            h.remove()
    return grams


def quantize_head(head: nn.Module, calibrate: Callable[[], None], qtype: str,
                  damp: float = DEFAULT_DAMP) -> dict[str, GGMLBlocks]:
    """Every packable linear of `head` rounded by GPTQ on the inputs `calibrate()` feeds it
    (a linear it never reached keeps ggml's reference rounding)."""
    grams = input_grams(head, calibrate)
    out = {}
    for key, linear in packable_linears(head).items():
        weight = linear.weight.detach().float()
        out[key] = (gptq_blocks(weight, grams[key], qtype, damp) if key in grams
                    else ggml_blocks.quantize(weight, qtype))
    return out


class DequantizedLinear(nn.Module):
    """A linear computing what the packed kernels compute, in PyTorch: the blocks' weights, the
    activations rounded per 32-block to int8 (`ggml_blocks.quantize_activations`). For held-out
    figures of the head as it runs packed."""

    def __init__(self, blocks: GGMLBlocks):
        super().__init__()
        self.register_buffer("weight", ggml_blocks.dequantize(blocks))  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = ggml_blocks.quantize_activations(x.reshape(-1, x.shape[-1]).float())
        return F.linear(flat, self.weight).reshape(*x.shape[:-1], self.weight.shape[0])


def with_blocks(head: nn.Module, blocks: dict[str, GGMLBlocks]) -> nn.Module:
    """`head` (modified in place) with each linear named in `blocks` computing as packed."""
    for key in packable_linears(head):
        if key in blocks:
            replace_linear(head, key, DequantizedLinear(blocks[key]))
    return head


# ---- the file beside the head -----------------------------------------------------------------

def save_packed(head_dir: str, blocks: dict[str, GGMLBlocks], qtype: str, info: dict) -> str:
    """Write `blocks` as `model.<qtype>.safetensors` (raw GGML rows [N, row_bytes] uint8 per
    weight key; `info` in the metadata). Returns the file's path."""
    from safetensors.torch import save_file

    tensors = {key: ggml_blocks.to_bytes(b).contiguous() for key, b in blocks.items()}
    path = packed_file(head_dir, qtype)
    save_file(tensors, path + ".tmp", metadata={"qtype": qtype, "info": json.dumps(info)})
    os.chmod(path + ".tmp", 0o644)  # as the head's other files (the writer makes it 0600)
    os.replace(path + ".tmp", path)
    return path


def load_packed(head_dir: str, qtype: str,
                shapes: dict[str, tuple[int, int]]) -> dict[str, GGMLBlocks] | None:
    """The head's pre-quantized blocks of `qtype` (None when it has none), checked against the
    float weights' shapes [out, in] by key: a file that does not fit is refused by name."""
    path = packed_file(head_dir, qtype) if head_dir and os.path.isdir(head_dir) else ""
    if not path or not os.path.isfile(path):
        return None
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            stored = (f.metadata() or {}).get("qtype")
            raw = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as exc:  # a truncated or foreign file
        raise ValueError(f"{path}: not a safetensors file of packed blocks ({exc})") from exc
    if stored != qtype:
        raise ValueError(f"{path}: holds {stored!r} blocks, expected {qtype}")
    return {key: _checked_blocks(path, key, raw, qtype, shapes) for key in shapes if key in raw}


def _checked_blocks(path: str, key: str, raw: dict, qtype: str,
                    shapes: dict[str, tuple[int, int]]) -> GGMLBlocks:
    out_features, in_features = shapes[key]
    row_bytes = in_features // BLOCK_SIZE * ggml_blocks.BLOCK_BYTES[qtype]
    rows = raw[key]
    if rows.dtype != torch.uint8 or tuple(rows.shape) != (out_features, row_bytes):
        raise ValueError(f"{path}: {key} is {rows.dtype} {list(rows.shape)}, expected uint8 "
                         f"[{out_features}, {row_bytes}] ({qtype} rows of {in_features} "
                         "weights)")
    return ggml_blocks.from_bytes(qtype, rows)
