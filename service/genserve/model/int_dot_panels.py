"""Quantized weights in the layout of the integer dot-product kernel
(``kernels/int_dot_cpu.cpp``, ``--cpu-int-dot``).

The column panels of :mod:`genserve.model.weight_panels` (32 output features per panel) with
``k`` grouped in quads: within a panel, for each quad of 4 consecutive input features, the 32
features' 4 weights are consecutive bytes, the operand of one VPDPBUSD (16 features x 4
bytes per 512-bit register).  ``K`` is padded to a multiple of 32 with zero weights.

* 8-bit: ``data`` uint8 ``[P, Kp / 4, 128]``, each byte ``q + 128``.
* 4-bit: ``data`` uint8 ``[P, Kp / 4, 64]``; byte ``j`` of a quad holds feature ``j // 4``
  (input ``j % 4`` of the quad) in its low nibble and feature ``16 + j // 4`` in its high one.
* ``scales`` (and 4-bit ``mins``) float16 ``[P, Kp / 32, 32]``: the weight's scale (and min)
  for every block of 32 inputs, also where the weight has one scale per row (``--quantize
  int8``), so the kernel reads one per block of activations.  A 4-bit weight whose every min
  is exactly ``-8 * scale`` (GGUF Q4_0) keeps no ``mins``: the kernels compute that value
  from the scale, and a one-row decode step streams 18 bytes per 32 weights (the file's)
  instead of 20.

Packing is exact (the same integers and float16 scales): the weights are
those of the :class:`QuantizedWeight`; only the activations are rounded (to int8 per block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.kernels.int_dot import Isa
from genserve.model.quantization import QuantizedWeight

PANEL = 32  # output features per panel
BLOCK = 32  # inputs per activation scale
# decode_layer_cpu.cpp's code for a projection in this layout: bits + this.
FUSED_BITS_OFFSET = 100


def _padded_k(k: int) -> int:
    return -(-k // BLOCK) * BLOCK


def _pad(t: torch.Tensor, rows: int, cols: int, value: int | float = 0) -> torch.Tensor:
    """``t`` grown to ``[rows, cols]`` with ``value``; ``t`` itself where it has that shape
    already (every matrix of a real model: no pass over the weights for nothing)."""
    if tuple(t.shape) == (rows, cols):
        return t
    out = torch.full((rows, cols), value, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _block_params(t: torch.Tensor, group: int, k: int, n_pad: int, blocks: int) -> torch.Tensor:
    """Per-group float16 ``[N, groups]`` -> ``[P, blocks, 32]``, one per block of 32."""
    if group == BLOCK and t.shape[1] == blocks:  # one per block already (GGUF): no gather
        per_block = _pad(t, n_pad, blocks)
    else:
        index = torch.clamp(torch.arange(blocks) * BLOCK // group, max=t.shape[1] - 1)
        per_block = _pad(t[:, index], n_pad, blocks)
    return per_block.view(n_pad // PANEL, PANEL, blocks).transpose(1, 2).contiguous()


def _symmetric(scales: torch.Tensor, mins: torch.Tensor) -> bool:
    """Whether every min is exactly ``-8 * scale`` (Q4_0's blocks), the value the kernels
    compute from a float16 scale when no mins are stored (float32 ``-8 * d``: exact, and
    bit-equal to the float16 min wherever that is finite, which this checks)."""
    if scales.dtype != torch.float16 or mins.dtype != torch.float16 or scales.shape != mins.shape:
        return False
    derived = scales.to(torch.float32) * -8.0
    bits_equal = torch.equal(derived.view(torch.int32), mins.to(torch.float32).view(torch.int32))
    return bool(bits_equal and torch.isfinite(derived).all())


@dataclass(frozen=True, slots=True)
class IntDotPanels:
    """A :class:`QuantizedWeight` as ``genserve::int_dot_linear`` reads it (module docstring)."""

    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    in_features: int
    out_features: int
    # From this many activation rows on, :meth:`linear` decodes the panels to bfloat16 and runs
    # torch's bfloat16 GEMM (``kernels/prefill_gemm.py``; 0: never).
    bf16_rows: int = 0

    @staticmethod
    def supports(quant: QuantizedWeight) -> bool:
        """Scales per block of 32 inputs (or one per row): Q8_0, Q4_0, Q4_1, --quantize."""
        return quant.bits in (8, 4) and (
            quant.group % BLOCK == 0 or quant.group == quant.in_features
        )

    @classmethod
    def pack(cls, quant: QuantizedWeight) -> IntDotPanels:
        n, k = quant.out_features, quant.in_features
        kp, n_pad = _padded_k(k), -(-n // PANEL) * PANEL
        p, blocks = n_pad // PANEL, kp // BLOCK
        # Each step below writes its result once, straight into the layout (``out=``), with
        # no wider temporary: packing is a large share of a GGUF start (issue #28).
        if quant.bits == 8:
            # q + 128 as a byte is q's two's-complement byte with the top bit flipped (so the
            # padding, 0 here, becomes 128: weight 0).
            q = _pad(quant.data.view(torch.uint8), n_pad, kp).contiguous()
            data = torch.empty((p, kp // 4, PANEL, 4), dtype=torch.uint8)
            # [P, 32, Kp/4, 4] -> [P, Kp/4, 32, 4]
            torch.bitwise_xor(q.view(p, PANEL, kp // 4, 4).permute(0, 2, 1, 3), 0x80, out=data)
            data = data.view(p, kp // 4, 128)
        else:
            codes = torch.empty((n, k // 32, 32), dtype=torch.uint8)  # 0..15, in input order
            nibbles = quant.data.contiguous().view(n, k // 32, 16)
            torch.bitwise_and(nibbles, 0x0F, out=codes[..., :16])
            torch.bitwise_right_shift(nibbles, 4, out=codes[..., 16:])
            q = _pad(codes.view(n, k), n_pad, kp)
            quads = q.view(p, PANEL, kp // 4, 4).permute(0, 2, 1, 3)  # [P, Kp/4, 32, 4]
            data = torch.empty((p, kp // 4, PANEL // 2, 4), dtype=torch.uint8)
            torch.bitwise_left_shift(quads[:, :, PANEL // 2 :], 4, out=data)
            data.bitwise_or_(quads[:, :, : PANEL // 2])
            data = data.view(p, kp // 4, 64)
        scales = _block_params(quant.scales, quant.group, k, n_pad, blocks)
        mins = None
        if quant.mins is not None and not _symmetric(quant.scales, quant.mins):
            mins = _block_params(quant.mins, quant.group, k, n_pad, blocks)
        return cls(data.contiguous(), scales, mins, quant.bits, k, n)

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.nbytes
        return int(self.data.nbytes + self.scales.nbytes + mins)

    @property
    def group(self) -> int:
        """Inputs per scale as the kernel reads them (every block of 32 has its own)."""
        return BLOCK

    @property
    def fused_bits(self) -> int:
        """This layout's code in ``genserve::decode_layer``'s ``bits`` list."""
        return self.bits + FUSED_BITS_OFFSET

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None, isa: Isa = Isa.AUTO
    ) -> torch.Tensor:
        if 0 < self.bf16_rows <= x.shape[0]:
            many: torch.Tensor = torch.ops.genserve.int_dot_linear_bf16(
                x, self.data, self.scales, self.mins, self.bits, self.out_features, bias, 0
            )
            return many
        out: torch.Tensor = torch.ops.genserve.int_dot_linear(
            x, self.data, self.scales, self.mins, self.bits, self.out_features, bias, int(isa)
        )
        return out

    def quantized_values(self) -> torch.Tensor:
        """The integer weights ``[N, K]`` as int32 (8-bit: -128..127; 4-bit: 0..15)."""
        p, kp = self.data.shape[0], self.data.shape[1] * 4
        if self.bits == 8:
            q = self.data.view(p, kp // 4, PANEL, 4).to(torch.int32) - 128
        else:
            half = self.data.view(p, kp // 4, PANEL // 2, 4)
            q = torch.cat((half & 0x0F, half >> 4), dim=2).to(torch.int32)  # [P, Kp/4, 32, 4]
        q = q.permute(0, 2, 1, 3).reshape(p * PANEL, kp)
        return q[: self.out_features, : self.in_features]

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the matrix, dequantized (``scale * q (+ min)``, as the
        :class:`QuantizedWeight` reference does); for an embedding tied to the head."""
        panel, col = ids // PANEL, ids % PANEL
        kp = self.data.shape[1] * 4
        if self.bits == 8:
            q = self.data.view(self.data.shape[0], kp // 4, PANEL, 4)[panel, :, col]
            q = q.to(torch.int32) - 128
        else:
            half = self.data.view(self.data.shape[0], kp // 4, PANEL // 2, 4)
            byte = half[panel, :, col % (PANEL // 2)]  # [n, Kp/4, 4]
            high = (col >= PANEL // 2)[:, None, None]
            q = torch.where(high, byte >> 4, byte & 0x0F).to(torch.int32)
        w = q.reshape(-1, kp // BLOCK, BLOCK).to(torch.float32)
        w = w * self.scales[panel, :, col].to(torch.float32)[..., None]
        if self.mins is not None:
            w = w + self.mins[panel, :, col].to(torch.float32)[..., None]
        elif self.bits == 4:  # Q4_0: m = -8 d
            w = w + self.scales[panel, :, col].to(torch.float32)[..., None] * -8.0
        return w.reshape(-1, kp)[:, : self.in_features].to(dtype)
