"""GGUF K-quant matrices (Q4_K, Q5_K, Q6_K) kept as the file stores them, and multiplied so.

A K-quant row is a run of *super-blocks* of 256 weights (ggml-quants.c's ``block_q4_K``,
``block_q5_K``, ``block_q6_K``: 144, 176 and 210 bytes, so 4.5, 5.5 and 6.5625 bits per weight).
Each super-block carries float16 scales for the whole block and 6- or 8-bit scales (and mins)
per group of 32 or 16 weights; the quants are packed in nibbles with the extra high bits apart.
:class:`KQuantWeight` holds those bytes untouched, row after row: a row is independent of the
others (row shards, the Q/K row permutation of llama GGUF files, embedding look-ups are row
gathers of bytes) and whole super-blocks are independent along the inputs (column shards of
256).  Nothing goes through float: ``kernels/kquant_cpu.cpp`` decodes a super-block in
registers, a row at a time, as it multiplies.

One projection may stack matrices of different types by rows: llama.cpp's Q4_K_M keeps Q and
K in Q4_K and V in Q6_K (in some layers), which genserve fuses into one QKV projection, so a
:class:`KQuantWeight` is a sequence of *segments*, each a run of rows of one type.

The reference dequantization (:meth:`KQuantWeight.reference_dequantize`, what
:meth:`KQuantWeight.dequantize` runs where the kernels are not loaded, e.g.
``--disable-cpu-kernels``) is gguf-py's own dequantizer, the one transformers loads a GGUF file
with, so the float values are those of the file by definition; the kernel's decode, which
``dequantize`` (embedding look-ups) uses where it can, is tested bit for bit against it
(tests/unit/test_kquants.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.quantization import QuantizationError, QuantizedWeight, cat_rows

SUPER_BLOCK = 256  # weights per K-quant super-block
# GGML type name -> (type code, as gguf's GGMLQuantizationType and the kernel name it; bytes
# per super-block)
K_TYPES: dict[str, tuple[int, int]] = {"Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}
# The kernel's float path (isa argument): dequantize each super-block to float32 and FMA.
FLOAT_PATH = -1
# Weight rows decoded to bfloat16 per panel of the many-row path (0: the kernel's default,
# about 4 MiB of bfloat16).
BF16_PANEL_ROWS = 0


def row_bytes(qtype: str, in_features: int) -> int:
    return in_features // SUPER_BLOCK * K_TYPES[qtype][1]


@dataclass(frozen=True, slots=True)
class KQuantWeight:
    """``W [N, K]`` as K-quant super-blocks: ``data`` uint8, flat, holds the rows of each
    segment in turn (segment ``s``: ``row_counts[s]`` rows of ``types[s]``, each
    ``row_bytes(type, K)`` bytes, GGUF's bytes).  ``isa`` is the kernel path
    :meth:`linear` takes: :data:`FLOAT_PATH`, or an integer path
    (``genserve.kernels.int_dot.Isa``: activations rounded to int8 per 256 inputs)."""

    data: torch.Tensor
    types: tuple[str, ...]
    row_counts: tuple[int, ...]
    in_features: int
    isa: int = FLOAT_PATH
    # From this many activation rows on, :meth:`linear` decodes W to bfloat16 and runs torch's
    # bfloat16 GEMM (``kernels/prefill_gemm.py``; 0: never).  Set by :meth:`serving`.
    bf16_rows: int = 0
    # From this many rows on (and below ``bf16_rows``, if set), the register-tiled integer GEMM
    # of CPUs without a native bfloat16 product (``kernels/prefill_gemm.py``; 0: never).
    int_gemm_rows: int = 0

    def __post_init__(self) -> None:
        if self.in_features <= 0 or self.in_features % SUPER_BLOCK:
            raise QuantizationError(
                f"K-quant rows need input features in whole super-blocks of {SUPER_BLOCK}, "
                f"got {self.in_features}"
            )
        if len(self.types) != len(self.row_counts) or not self.types:
            raise QuantizationError("a K-quant matrix needs one row count per segment type")
        unknown = [t for t in self.types if t not in K_TYPES]
        if unknown:
            raise QuantizationError(f"not a K-quant type: {unknown} (Q4_K, Q5_K, Q6_K)")
        expected = sum(r * row_bytes(t, self.in_features) for t, r in self.segments_meta())
        if self.data.dtype != torch.uint8 or self.data.dim() != 1 or self.data.numel() != expected:
            raise QuantizationError(
                f"K-quant data must be flat uint8 of {expected} bytes, got "
                f"{self.data.dtype} {tuple(self.data.shape)}"
            )

    @classmethod
    def from_owned(cls, blocks: np.ndarray, qtype: str) -> KQuantWeight:
        """One matrix from its GGUF bytes, uint8 ``[N, K / 256 * block bytes]``, taken over
        without a copy (the caller gives up ``blocks``)."""
        if qtype not in K_TYPES:
            raise QuantizationError(f"not a K-quant type: {qtype}")
        n, width = blocks.shape
        k = width // K_TYPES[qtype][1] * SUPER_BLOCK
        return cls(torch.from_numpy(blocks).reshape(-1), (qtype,), (int(n),), int(k))

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor | np.ndarray, qtype: str) -> KQuantWeight:
        """One matrix from its GGUF bytes, uint8 ``[N, K / 256 * block bytes]`` (copied)."""
        if qtype not in K_TYPES:
            raise QuantizationError(f"not a K-quant type: {qtype}")
        t = torch.from_numpy(np.array(blocks, dtype=np.uint8, copy=True))
        n, width = t.shape
        k = width // K_TYPES[qtype][1] * SUPER_BLOCK
        return cls(t.reshape(-1), (qtype,), (int(n),), int(k))

    # ------------------------------------------------------------------ shape
    @property
    def out_features(self) -> int:
        return sum(self.row_counts)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def segments_meta(self) -> list[tuple[str, int]]:
        return list(zip(self.types, self.row_counts, strict=True))

    def segments(self) -> list[tuple[str, torch.Tensor]]:
        """Each segment's type and bytes as ``[rows, row bytes]`` (views of ``data``)."""
        out, offset = [], 0
        for qtype, rows in self.segments_meta():
            width = row_bytes(qtype, self.in_features)
            out.append((qtype, self.data[offset : offset + rows * width].view(rows, width)))
            offset += rows * width
        return out

    # ------------------------------------------------------------------ slicing
    def rows(self, index: torch.Tensor | slice) -> KQuantWeight:
        """The matrix of the selected output rows, in the order given."""
        if len(self.types) == 1:  # the common case (every look-up of an embedding): a gather
            ((qtype, block),) = self.segments()
            picked = block[index].contiguous()
            picked = picked[None] if picked.dim() == 1 else picked  # a single index
            return KQuantWeight(
                picked.reshape(-1), (qtype,), (picked.shape[0],), self.in_features, self.isa
            )
        ids = torch.arange(self.out_features)[index]
        if ids.dim() == 0:
            ids = ids[None]
        parts: list[KQuantWeight] = []
        start = 0
        segment_of = torch.empty(self.out_features, dtype=torch.long)
        for s, (_, rows) in enumerate(self.segments_meta()):
            segment_of[start : start + rows] = s
            start += rows
        bounds = torch.cumsum(torch.tensor((0, *self.row_counts)), 0)
        seg_ids = segment_of[ids]
        segments = self.segments()
        # consecutive ids of one segment form one part
        cuts = (torch.nonzero(seg_ids[1:] != seg_ids[:-1]).flatten() + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
            if a == b:
                continue
            s = int(seg_ids[a])
            qtype, block = segments[s]
            local = ids[a:b] - bounds[s]
            picked = block[local].contiguous()
            parts.append(KQuantWeight(picked.reshape(-1), (qtype,), (b - a,), self.in_features))
        if not parts:  # no rows selected
            return KQuantWeight(
                self.data[:0].clone(), self.types[:1], (0,), self.in_features, self.isa
            )
        return dataclasses.replace(cat_kquant(parts), isa=self.isa)

    def columns(self, start: int, stop: int) -> KQuantWeight:
        """Input features ``[start, stop)`` (a row-parallel shard); whole super-blocks only."""
        if (start, stop) == (0, self.in_features):
            return self
        if start % SUPER_BLOCK or stop % SUPER_BLOCK:
            raise QuantizationError(
                f"columns [{start}, {stop}) do not fall on K-quant super-blocks of {SUPER_BLOCK}"
            )
        b0, b1 = start // SUPER_BLOCK, stop // SUPER_BLOCK
        pieces = []
        for qtype, block in self.segments():
            size = K_TYPES[qtype][1]
            per_row = block.view(block.shape[0], -1, size)[:, b0:b1]
            pieces.append(per_row.reshape(-1))
        return KQuantWeight(
            torch.cat(pieces).contiguous(), self.types, self.row_counts, stop - start, self.isa
        )

    def to(self, device: torch.device) -> KQuantWeight:
        if self.data.device == device:
            return self  # a tied embedding and head keep sharing one object
        return dataclasses.replace(self, data=self.data.to(device))

    # ------------------------------------------------------------------ values
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [N, K]`` in ``dtype``: gguf-py's dequantizer (float32) on each segment, or the
        kernel's decode (``genserve::kquant_dequantize``, the same float32 values bit for bit,
        tests/unit/test_kquants.py) where the CPU kernels are loaded: an embedding look-up of
        a K-quant matrix runs this every decode step, and gguf-py's numpy code took ~0.2-0.4
        ms for one row (1% of a 1B step) against microseconds."""
        if self.data.device.type == "cpu" and cpu_kernels.enabled_and_loaded():
            codes = [K_TYPES[t][0] for t in self.types]
            decoded: torch.Tensor = torch.ops.genserve.kquant_dequantize(
                self.data, codes, list(self.row_counts), self.in_features
            )
            return decoded.to(dtype)
        return self.reference_dequantize(dtype)

    def reference_dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [N, K]`` in ``dtype`` by gguf-py's dequantizer (float32) on each segment."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        pieces = []
        for qtype, block in self.segments():
            raw = block.cpu().numpy()
            values = dequantize(raw, GGMLQuantizationType[qtype])
            pieces.append(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))
        w = torch.cat(pieces).reshape(self.out_features, self.in_features)
        return w.to(device=self.data.device, dtype=dtype)

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids``, dequantized (an embedding look-up, a tied head's matrix)."""
        return self.rows(ids.cpu()).dequantize(dtype)

    # ------------------------------------------------------------------ kernel
    def serving(self, isa: int, bf16_rows: int = 0, int_gemm_rows: int = 0) -> KQuantWeight:
        """This matrix as the kernel serves it on path ``isa`` (same bytes), steps of at least
        ``bf16_rows`` rows (0: none) by the bfloat16 GEMM, of at least ``int_gemm_rows`` (0:
        none) by the integer GEMM (integer paths only)."""
        return dataclasses.replace(self, isa=isa, bf16_rows=bf16_rows, int_gemm_rows=int_gemm_rows)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x Wᵀ + b`` by ``genserve::kquant_linear`` (``x`` float32 / half ``[M, K]``), or
        for ``bf16_rows`` rows and more by ``genserve::kquant_linear_bf16``, or for
        ``int_gemm_rows`` rows and more by ``genserve::kquant_linear_int_gemm``."""
        codes = [K_TYPES[t][0] for t in self.types]
        if 0 < self.bf16_rows <= x.shape[0]:
            many: torch.Tensor = torch.ops.genserve.kquant_linear_bf16(
                x, self.data, codes, list(self.row_counts), bias, BF16_PANEL_ROWS
            )
            return many
        if 0 < self.int_gemm_rows <= x.shape[0] and self.isa != FLOAT_PATH:
            tiled: torch.Tensor = torch.ops.genserve.kquant_linear_int_gemm(
                x, self.data, codes, list(self.row_counts), bias
            )
            return tiled
        out: torch.Tensor = torch.ops.genserve.kquant_linear(
            x, self.data, codes, list(self.row_counts), bias, self.isa
        )
        return out


def cat_kquant(parts: Sequence[KQuantWeight]) -> KQuantWeight:
    """Stack K-quant matrices along the output features; adjacent runs of one type merge."""
    k = parts[0].in_features
    if any(p.in_features != k for p in parts):
        raise QuantizationError("fused K-quant matrices have different input features")
    types: list[str] = []
    counts: list[int] = []
    for part in parts:
        for qtype, rows in part.segments_meta():
            if rows == 0:
                continue
            if types and types[-1] == qtype:
                counts[-1] += rows
            else:
                types.append(qtype)
                counts.append(rows)
    if not types:
        return parts[0]
    data = torch.cat([p.data for p in parts])
    return KQuantWeight(data, tuple(types), tuple(counts), k, parts[0].isa)


AnyQuantized = QuantizedWeight | KQuantWeight


def cat_any(parts: Sequence[AnyQuantized]) -> AnyQuantized:
    """Stack quantized matrices by rows (fused Q/K/V, gate/up): K-quants with K-quants (of
    any mix of types), block formats of one kind together.  Raises QuantizationError for a
    mix the kernels have no layout for (a Q8_0 part beside K-quant ones)."""
    if all(isinstance(p, KQuantWeight) for p in parts):
        return cat_kquant([p for p in parts if isinstance(p, KQuantWeight)])
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return cat_rows([p for p in parts if isinstance(p, QuantizedWeight)])
    raise QuantizationError("fused matrices mix K-quant and other block formats")


def zero_rows(like: AnyQuantized, rows: int) -> AnyQuantized:
    """``rows`` rows of zeros in ``like``'s format (vocabulary padding of a shard)."""
    if isinstance(like, KQuantWeight):
        qtype = like.types[-1]
        data = torch.zeros(rows * row_bytes(qtype, like.in_features), dtype=torch.uint8)
        return KQuantWeight(data, (qtype,), (rows,), like.in_features, like.isa)

    def zeros(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros((rows, t.shape[1]), dtype=t.dtype)

    mins = None if like.mins is None else zeros(like.mins)
    return QuantizedWeight(zeros(like.data), zeros(like.scales), mins, like.bits, like.group)
