"""PackedLinear: a weight matrix kept in its compact (quantized or half) form, and its matmul."""
from __future__ import annotations

import numpy as np
import torch

from speculant.kernels import ggml_blocks
from speculant.kernels.ggml_blocks import GGMLBlocks
from speculant.kernels.native import native_available

QTYPES = ("Q4_0", "Q4_1", "Q8_0", "F16", "F32")
ROWS_PER_GROUP = 8  # output rows interleaved together (one AVX2 vector of results)
# The fallback multiplies in fixed-size row chunks: every matmul call then has one shape, so a
# row's result does not depend on how many rows came with it (BLAS picks kernels by shape).
FALLBACK_ROW_CHUNK = 16
FALLBACK_MAX_ELEMENTS = 1 << 22  # weights dequantized at once by the fallback (16 MB of fp32)
_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16}


class PackedLinear:
    """A weight matrix [out_features, in_features] kept in its compact form.

    Memory layout: output rows are interleaved in G = ceil(out_features / 8) groups of 8 (the last
    group padded with zero rows), so one AVX2 vector holds results for 8 outputs. With
    nb = in_features / 32 GGML blocks per row:

        Q4_0, Q4_1  data   uint8 [G, nb, 128]  chunk v (32 bytes) = bytes 4v..4v+3 of each of the
                                               8 rows' nibble blocks, row after row
                    scales fp16  [G, nb, 8]    d of each row's block; `mins` likewise (Q4_1)
        Q8_0        data   int8  [G, nb, 256]  chunk c = elements 4c..4c+3 of each of the 8 rows
                    scales fp16  [G, nb, 8]
        F32, F16    data   [G, in_features, 8] for each input feature, the 8 rows' weights

    `x @ W.T` runs natively (csrc/linear.cpp: AVX2, or AVX-512 VNNI for the block types where
    the CPU has it, with bit-identical results; activations quantized on the fly to int8 per
    row per block of 32 for the block types; batch-invariant: an output row is bit-identical
    whatever M is) when the weights are on the CPU and `native_available()`. Otherwise the
    PyTorch fallback dequantizes the weights per call, at most 16 MB of them at a time (the
    compact storage is never inflated for good), and, for block types, rounds the activations the
    way the native kernel does, so both paths agree to ~1e-6 relative.
    """

    __slots__ = ("qtype", "out_features", "in_features", "data", "scales", "mins")

    def __init__(self, qtype: str, out_features: int, in_features: int, data: torch.Tensor,
                 scales: torch.Tensor | None = None, mins: torch.Tensor | None = None):
        if qtype not in QTYPES:
            raise ValueError(f"unsupported qtype {qtype!r}; expected one of {QTYPES}")
        self.qtype = qtype
        self.out_features = out_features
        self.in_features = in_features
        self.data = data  # layout in the class docstring
        self.scales = scales  # [G, nb, 8] float16, block types only
        self.mins = mins  # [G, nb, 8] float16, Q4_1 only

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, qtype: str, data: np.ndarray, out_features: int,
                  in_features: int) -> PackedLinear:
        """From a GGUF tensor's data as-is: raw GGML rows (uint8 [out, row_bytes]) for block
        types, the float array for F16/F32."""
        # GGUFReader hands out read-only memory maps; torch wants writable memory
        array = torch.from_numpy(np.require(data, requirements=["C", "W"]))
        if qtype in _FLOAT_DTYPES:
            return cls._from_rows(qtype, array.reshape(out_features, in_features))
        blocks = ggml_blocks.from_bytes(qtype, array.view(torch.uint8).reshape(out_features, -1))
        if blocks.qs.shape[1] * ggml_blocks.BLOCK_SIZE != in_features:
            raise ValueError(f"{qtype} data of shape {tuple(data.shape)} does not hold "
                             f"{out_features} rows of {in_features} weights")
        return cls._from_blocks(blocks)

    @classmethod
    def from_float(cls, weight: torch.Tensor, qtype: str) -> PackedLinear:
        """Quantizes weight [out, in] (the same maths as ggml's reference quantizer) or keeps it
        as F32 / F16 (round to nearest)."""
        if weight.dim() != 2:
            raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        if qtype in _FLOAT_DTYPES:
            return cls._from_rows(qtype, weight.detach())
        return cls._from_blocks(ggml_blocks.quantize(weight, qtype))

    @classmethod
    def from_blocks(cls, blocks: GGMLBlocks) -> PackedLinear:
        """From GGML blocks quantized elsewhere (a head's GPTQ blocks: `models/head_quant.py`),
        bit for bit."""
        return cls._from_blocks(blocks)

    @classmethod
    def concat(cls, parts: list[PackedLinear]) -> PackedLinear:
        """Stacks the rows of `parts` (e.g. fused QKV, gate+up); same qtype and in_features."""
        first = parts[0]
        for p in parts[1:]:
            if (p.qtype, p.in_features) != (first.qtype, first.in_features):
                raise ValueError(f"cannot concat {p.qtype} [*, {p.in_features}] with "
                                 f"{first.qtype} [*, {first.in_features}]")
        if first.qtype in _FLOAT_DTYPES:
            return cls._from_rows(first.qtype, torch.cat([p._float_rows() for p in parts]))
        rows = [p._blocks() for p in parts]
        mins = None if first.mins is None else torch.cat([b.mins for b in rows])
        return cls._from_blocks(GGMLBlocks(first.qtype, torch.cat([b.qs for b in rows]),
                                           torch.cat([b.scales for b in rows]), mins))

    def select_rows(self, ids: torch.Tensor) -> PackedLinear:
        """A new matrix of rows `ids` ([n] int64) of this one, in the same qtype, bit for bit
        (a draft's LM head restricted to the tokens it may propose, say)."""
        if self.qtype in _FLOAT_DTYPES:
            return self._from_rows(self.qtype, self._float_rows()[ids])
        b = self._blocks()
        return self._from_blocks(GGMLBlocks(self.qtype, b.qs[ids], b.scales[ids],
                                            None if b.mins is None else b.mins[ids]))

    @classmethod
    def _from_rows(cls, qtype: str, weight: torch.Tensor) -> PackedLinear:
        # weight [N, K] -> [G, K, 8]
        n, k = weight.shape
        data = _group_rows(weight.to(_FLOAT_DTYPES[qtype])).transpose(1, 2).contiguous()
        return cls(qtype, n, k, data)

    @classmethod
    def _from_blocks(cls, blocks: GGMLBlocks) -> PackedLinear:
        n, nb = blocks.scales.shape
        mins = None if blocks.mins is None else _interleave_fields(blocks.mins)
        return cls(blocks.qtype, n, nb * ggml_blocks.BLOCK_SIZE, _interleave_qs(blocks.qs),
                   _interleave_fields(blocks.scales), mins)

    # ---- use ---------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, *, native: bool | None = None) -> torch.Tensor:
        """x [..., in] float32 -> [..., out] float32. `native=None` picks the native kernel when it
        can run (CPU weights, extension available); False forces the PyTorch fallback."""
        op = self._native_op(native)
        if x.dim() == 2 and op is not None:  # the decode hot path: nothing else in Python
            return op(x, self.data, self.scales, self.mins, self.qtype, self.out_features)
        x2 = x.reshape(-1, self.in_features)  # [M, in]
        if op is not None:
            out = op(x2, self.data, self.scales, self.mins, self.qtype, self.out_features)
        else:
            out = self._fallback(x2.float())
        return out.reshape(*x.shape[:-1], self.out_features)

    def with_argmax(self, x: torch.Tensor, *, native: bool | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [M, in] float32 -> (out [M, out] as __call__ gives it, each row's argmax [M] int64
        as torch.argmax gives it, or None off the native path). Natively the argmax is found as
        the rows are written (csrc/linear.cpp `RowArgmax`), not in a second pass over them: the
        LM head's greedy picks."""
        op = self._native_op(native)
        if op is None or x.dim() != 2:
            return self(x, native=native), None
        return torch.ops.speculant.packed_linear_argmax.default(
            x, self.data, self.scales, self.mins, self.qtype, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32, bit-identical to gguf.quants.dequantize of the original blocks."""
        return self._dequantize_groups(0, self.data.shape[0])[: self.out_features]

    def embed(self, ids: torch.Tensor, *, native: bool | None = None) -> torch.Tensor:
        """Rows `ids` ([n] int64) of the matrix, exactly dequantized: [n, in] float32 (natively
        by csrc/embed.cpp when it can run, as for __call__)."""
        op = self._native_embed_op(native)
        if op is not None:
            return op(ids, self.data, self.scales, self.mins, self.qtype, self.out_features)
        # The ids' groups are gathered first, then each row picked from its group with the two
        # index tensors side by side: indexing the whole table at (group, ..., row) with a slice
        # between them makes torch copy all of it (~4 ms for a 30 MB token table).
        group, row = ids // ROWS_PER_GROUP, ids % ROWS_PER_GROUP
        n = len(ids)
        picked = torch.arange(n, device=ids.device)
        if self.qtype in _FLOAT_DTYPES:
            return self.data.index_select(0, group).transpose(1, 2)[picked, row].float()  # [n, in]
        nb = self.scales.shape[1]
        # data [n, nb, chunks, 8, 4] -> [n, 8, nb, chunks, 4] -> each id's row: [n, nb, chunks, 4]
        qs = self.data.index_select(0, group).view(n, nb, -1, ROWS_PER_GROUP, 4)
        qs = qs.permute(0, 3, 1, 2, 4)[picked, row]

        def fields(f):  # [G, nb, 8] -> [n, nb]
            return f.index_select(0, group).transpose(1, 2)[picked, row]

        mins = None if self.mins is None else fields(self.mins)
        blocks = GGMLBlocks(self.qtype, qs.reshape(n, nb, -1), fields(self.scales), mins)
        return ggml_blocks.dequantize(blocks)

    def to(self, device) -> PackedLinear:
        def move(t):
            return None if t is None else t.to(device)

        return PackedLinear(self.qtype, self.out_features, self.in_features, move(self.data),
                            move(self.scales), move(self.mins))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scales, self.mins) if t is not None)

    def __repr__(self) -> str:
        return (f"PackedLinear({self.qtype}, out_features={self.out_features}, "
                f"in_features={self.in_features}, device={self.device})")

    # ---- internals ---------------------------------------------------------------------------

    def _native_op(self, native: bool | None):
        if native is not False and self.data.is_cpu and native_available():
            return torch.ops.speculant.packed_linear.default
        if native:
            raise RuntimeError(f"native kernels requested but unavailable for {self} "
                               "(SPECULANT_NATIVE=0, CPU without AVX2/FMA/F16C, build failure, "
                               "or weights not on the CPU)")
        return None

    def _native_embed_op(self, native: bool | None):
        if self._native_op(native) is not None:
            return torch.ops.speculant.packed_embed.default
        return None

    def _fallback(self, x: torch.Tensor) -> torch.Tensor:
        # x [M, in] float32 -> [M, out]; weights dequantized a slab of groups at a time
        if self.qtype not in _FLOAT_DTYPES:
            x = ggml_blocks.quantize_activations(x)
        num_groups = self.data.shape[0]
        groups_per_slab = max(1, FALLBACK_MAX_ELEMENTS // (ROWS_PER_GROUP * self.in_features))
        slabs = []
        for g0 in range(0, num_groups, groups_per_slab):
            w = self._dequantize_groups(g0, min(num_groups, g0 + groups_per_slab))  # [rows, in]
            slabs.append(_matmul_fixed_chunks(x, w))
        return torch.cat(slabs, dim=1)[:, : self.out_features]

    def _dequantize_groups(self, g0: int, g1: int) -> torch.Tensor:
        # groups [g0, g1) -> their rows [8 (g1 - g0), in] float32
        if self.qtype in _FLOAT_DTYPES:
            return self.data[g0:g1].transpose(1, 2).reshape(-1, self.in_features).float()
        return ggml_blocks.dequantize(self._blocks(g0, g1))

    def _blocks(self, g0: int = 0, g1: int | None = None) -> GGMLBlocks:
        # groups [g0, g1) as GGML rows; the whole matrix (padding rows dropped) by default
        full = g1 is None
        g1 = self.data.shape[0] if full else g1
        mins = None if self.mins is None else _deinterleave_fields(self.mins[g0:g1])
        blocks = GGMLBlocks(self.qtype, _deinterleave_qs(self.data[g0:g1]),
                            _deinterleave_fields(self.scales[g0:g1]), mins)
        if full:
            n = self.out_features
            blocks = GGMLBlocks(self.qtype, blocks.qs[:n], blocks.scales[:n],
                                None if mins is None else blocks.mins[:n])
        return blocks

    def _float_rows(self) -> torch.Tensor:
        # [out, in] in the stored dtype
        g, k, _ = self.data.shape
        return self.data.transpose(1, 2).reshape(g * ROWS_PER_GROUP, k)[: self.out_features]


def _group_rows(t: torch.Tensor) -> torch.Tensor:
    # [N, ...] -> [G, 8, ...], zero rows appended to fill the last group
    pad = -t.shape[0] % ROWS_PER_GROUP
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, ROWS_PER_GROUP, *t.shape[1:])


def _interleave_fields(f: torch.Tensor) -> torch.Tensor:
    # [N, nb] -> [G, nb, 8]
    return _group_rows(f).transpose(1, 2).contiguous()


def _deinterleave_fields(f: torch.Tensor) -> torch.Tensor:
    # [G, nb, 8] -> [8 G, nb]
    return f.transpose(1, 2).reshape(-1, f.shape[1])


def _interleave_qs(qs: torch.Tensor) -> torch.Tensor:
    # [N, nb, bytes] -> [G, nb, bytes * 8]: 4-byte chunk c of row r lands at (c, r)
    grouped = _group_rows(qs)  # [G, 8, nb, bytes]
    g, _, nb, nbytes = grouped.shape
    chunks = grouped.reshape(g, ROWS_PER_GROUP, nb, nbytes // 4, 4)
    return chunks.permute(0, 2, 3, 1, 4).reshape(g, nb, nbytes * ROWS_PER_GROUP).contiguous()


def _deinterleave_qs(data: torch.Tensor) -> torch.Tensor:
    # [G, nb, bytes * 8] -> [8 G, nb, bytes]
    g, nb, total = data.shape
    chunks = data.reshape(g, nb, total // (4 * ROWS_PER_GROUP), ROWS_PER_GROUP, 4)
    return chunks.permute(0, 3, 1, 2, 4).reshape(g * ROWS_PER_GROUP, nb, total // ROWS_PER_GROUP)


def _matmul_fixed_chunks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # x [M, K] @ w [N, K].T in [16, K] row chunks (the last one zero-padded) -> [M, N]
    m = x.shape[0]
    pad = -m % FALLBACK_ROW_CHUNK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    wt = w.t()
    out = torch.cat([chunk @ wt for chunk in x.split(FALLBACK_ROW_CHUNK)])
    return out[:m]
