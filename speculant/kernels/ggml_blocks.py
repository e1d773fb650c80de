"""GGML's 32-element block formats Q4_0, Q4_1 and Q8_0, in pure PyTorch (any device).

A row of `in_features` weights is `in_features / 32` blocks; each block stores fp16 fields and
32 quantized values:

    Q4_0  18 bytes: d (fp16), 16 bytes of nibbles            w = d * (q - 8),  q in 0..15
    Q4_1  20 bytes: d, m (fp16), 16 bytes of nibbles         w = d * q + m,    q in 0..15
    Q8_0  34 bytes: d (fp16), 32 int8                        w = d * q,        q in -127..127

Nibble byte j of a 4-bit block holds element j (low nibble) and element j + 16 (high nibble).
Quantization and dequantization follow ggml's reference maths (as gguf-py implements it) to the
bit, in fp32: same scale formulas, same rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
QUANT_TYPES = tuple(BLOCK_BYTES)


@dataclass(slots=True)
class GGMLBlocks:
    """Rows of GGML blocks split into their fields; block b of a row covers elements 32b..32b+31."""

    qtype: str
    qs: torch.Tensor  # [N, nb, 16] uint8 nibble pairs (Q4_*) or [N, nb, 32] int8 (Q8_0)
    scales: torch.Tensor  # [N, nb] float16, d
    mins: torch.Tensor | None  # [N, nb] float16, m (Q4_1 only)

    @property
    def num_rows(self) -> int:
        return self.qs.shape[0]


def from_bytes(qtype: str, raw: torch.Tensor) -> GGMLBlocks:
    """Splits raw GGML rows [N, row_bytes] uint8 (as stored in a GGUF file) into fields."""
    check_qtype(qtype)
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, BLOCK_BYTES[qtype])  # [N, nb, block_bytes]
    scales = _fp16(blocks[..., 0:2])
    if qtype == "Q4_1":
        return GGMLBlocks(qtype, blocks[..., 4:].contiguous(), scales, _fp16(blocks[..., 2:4]))
    qs = blocks[..., 2:].contiguous()
    return GGMLBlocks(qtype, qs.view(torch.int8) if qtype == "Q8_0" else qs, scales, None)


def to_bytes(blocks: GGMLBlocks) -> torch.Tensor:
    """The inverse of `from_bytes`: raw GGML rows [N, row_bytes] uint8."""
    fields = [_bytes(blocks.scales)]
    if blocks.mins is not None:
        fields.append(_bytes(blocks.mins))
    fields.append(blocks.qs.view(torch.uint8))
    return torch.cat(fields, dim=-1).reshape(blocks.num_rows, -1)


def quantize(weight: torch.Tensor, qtype: str) -> GGMLBlocks:
    """Quantizes rows [N, K] (K a multiple of 32) exactly as ggml's reference quantizer does."""
    check_qtype(qtype)
    n, k = weight.shape
    if k % BLOCK_SIZE:
        raise ValueError(f"{qtype} needs in_features to be a multiple of 32, got {k}")
    x = weight.detach().float().reshape(n, k // BLOCK_SIZE, BLOCK_SIZE)  # [N, nb, 32]
    return {"Q4_0": _quantize_q4_0, "Q4_1": _quantize_q4_1, "Q8_0": _quantize_q8_0}[qtype](x)


def from_values(qtype: str, q: torch.Tensor, scales: torch.Tensor,
                mins: torch.Tensor | None = None) -> GGMLBlocks:
    """Blocks from quantized values chosen elsewhere (`models/head_quant.py`'s GPTQ):
    q [N, nb, 32] (0..15 for Q4_*, -127..127 for Q8_0), scales (and Q4_1's mins) [N, nb] fp16."""
    check_qtype(qtype)
    if q.dim() != 3 or q.shape[-1] != BLOCK_SIZE or tuple(scales.shape) != tuple(q.shape[:2]):
        raise ValueError(f"{qtype} values must be [N, nb, 32] with scales [N, nb], got "
                         f"{tuple(q.shape)} and {tuple(scales.shape)}")
    if (mins is not None) != (qtype == "Q4_1"):
        raise ValueError(f"{qtype} blocks {'need' if qtype == 'Q4_1' else 'have no'} mins")
    if qtype == "Q8_0":
        return GGMLBlocks(qtype, q.to(torch.int8), scales.half(), None)
    return GGMLBlocks(qtype, _pack_nibbles(q.to(torch.uint8)), scales.half(),
                      None if mins is None else mins.half())


def dequantize(blocks: GGMLBlocks) -> torch.Tensor:
    """Rows [N, K] float32, bit-identical to gguf.quants.dequantize."""
    d = blocks.scales.float().unsqueeze(-1)  # [N, nb, 1]
    if blocks.qtype == "Q8_0":
        w = blocks.qs.float() * d
    elif blocks.qtype == "Q4_0":
        w = d * (unpack_nibbles(blocks.qs).to(torch.int8) - 8).float()
    else:
        w = d * unpack_nibbles(blocks.qs).float() + blocks.mins.float().unsqueeze(-1)
    return w.reshape(blocks.num_rows, -1)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] uint8 nibble pairs -> [..., 32] uint8 values 0..15 in element order."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded the way the native kernels quantize activations: per row, per block of 32,
    int8 with scale max|x| / 127 and round-half-to-even. Returns the dequantized values [M, K]."""
    m, k = x.shape
    blocks = x.reshape(m, k // BLOCK_SIZE, BLOCK_SIZE)  # [M, nb, 32]
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax != 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(m, k)


def check_qtype(qtype: str) -> None:
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"unsupported block type {qtype!r}; expected one of {QUANT_TYPES}")


def _quantize_q8_0(x: torch.Tensor) -> GGMLBlocks:
    d = x.abs().amax(dim=-1, keepdim=True) / 127
    inv = _reciprocal_or_zero(d)
    qs = _round_half_away(x * inv).to(torch.int8)
    return GGMLBlocks("Q8_0", qs, d.squeeze(-1).half(), None)


def _quantize_q4_0(x: torch.Tensor) -> GGMLBlocks:
    # the signed value of largest magnitude (first one on ties) maps to -8
    peak = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    d = peak / -8
    q = torch.trunc(x * _reciprocal_or_zero(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return GGMLBlocks("Q4_0", _pack_nibbles(q), d.squeeze(-1).half(), None)


def _quantize_q4_1(x: torch.Tensor) -> GGMLBlocks:
    lo = x.amin(dim=-1, keepdim=True)
    d = (x.amax(dim=-1, keepdim=True) - lo) / 15
    q = torch.trunc((x - lo) * _reciprocal_or_zero(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return GGMLBlocks("Q4_1", _pack_nibbles(q), d.squeeze(-1).half(), lo.squeeze(-1).half())


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    # ggml rounds with roundf (halves away from zero); torch.round would round halves to even.
    # Written like gguf-py's np_roundf, whose steps are all exact in fp32.
    a = v.abs()
    floored = torch.floor(a)
    return torch.sign(v) * (floored + torch.floor(2 * (a - floored)))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    # q [..., 32] values 0..15 -> [..., 16]: byte j = q[j] | q[j + 16] << 4
    return q[..., :16] | (q[..., 16:] << 4)


def _fp16(two_bytes: torch.Tensor) -> torch.Tensor:
    # [..., 2] uint8 little-endian -> [...] float16
    return two_bytes.contiguous().view(torch.float16).squeeze(-1)


def _bytes(halves: torch.Tensor) -> torch.Tensor:
    # [...] float16 -> [..., 2] uint8
    return halves.contiguous().unsqueeze(-1).view(torch.uint8)
