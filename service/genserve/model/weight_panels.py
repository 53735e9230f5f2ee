"""Weights in 32-column panels, the layout of genserve's CPU matmul kernel
(``kernels/panel_gemm_cpu.cpp``): panel ``p`` holds output features ``[32p, 32p + 32)``
k-major, so one k-step of a panel is one contiguous vector load.

This module is the one place that lays the panels out: float32 weights (:func:`pack_float`;
as float16 where every value is one, :func:`pack_half_exact`) and quantized ones
(:class:`QuantizedPanels`, from a :class:`QuantizedWeight`), and it looks rows up in either,
for an embedding that shares its matrix with the LM head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from genserve.model.quantization import QuantizedWeight

PANEL = 32  # output features per panel (the kernel's kPanel)
# "0" keeps float32 panels for float16-valued weights too (benchmarks of the difference).
ENV_HALF_PANELS = "GENSERVE_HALF_PANELS"


def _panels(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[N, X]`` -> ``[P, X, 32]``: output rows padded to whole panels (zeros), each panel
    transposed so its 32 rows become the innermost dimension.  Written straight into the
    result (only the last, partial panel goes through a padded copy): a padded copy of the
    whole matrix would hold it three times at once while loading (the embedding of a
    real model: hundreds of MB)."""
    p, x = -(-n // PANEL), int(t.shape[1])
    out = torch.empty((p, x, PANEL), dtype=t.dtype, device=t.device)
    full = n // PANEL
    if full:
        out[:full].copy_(t[: full * PANEL].reshape(full, PANEL, x).transpose(1, 2))
    if full < p:
        tail = torch.zeros((PANEL, x), dtype=t.dtype, device=t.device)
        tail[: n - full * PANEL] = t[full * PANEL :]
        out[full].copy_(tail.t())
    return out


def pack_float(weight: torch.Tensor) -> torch.Tensor:
    """A float32 ``[N, K]`` weight as ``genserve::panel_linear`` reads it: ``[ceil(N / 32), K,
    32]``, the last panel's missing columns zero."""
    if weight.dtype != torch.float32 or weight.dim() != 2:
        raise ValueError(f"pack_float: a float32 [N, K] weight expected, got {weight.dtype}")
    return _panels(weight, int(weight.shape[0]))


def half_panels_enabled() -> bool:
    """Whether float32 weights whose values are all float16 are packed as float16 panels
    (default yes; ``GENSERVE_HALF_PANELS=0`` turns it off: the results are the same, so the
    switch only serves to measure the difference)."""
    return os.environ.get(ENV_HALF_PANELS, "1").strip() != "0"


def is_exact_half(weight: torch.Tensor) -> bool:
    """Whether every value of the float32 ``weight`` is a float16 value (an F16 file's
    matrices read into float32 are; a float32 or bfloat16 checkpoint's almost never are).
    The first row is tried alone first, so a matrix that is not costs one row's test."""
    if weight.dtype != torch.float32 or not weight.numel():
        return False
    flat = weight.reshape(-1)
    for part in (flat[: weight.shape[-1]], flat):
        if not torch.equal(part.to(torch.float16).to(torch.float32), part):
            return False
    return True


def pack_half_exact(weight: torch.Tensor) -> torch.Tensor | None:
    """A float32 ``[N, K]`` weight all of whose values are float16 values, as float16
    panels (``[ceil(N / 32), K, 32]``, which ``genserve::panel_linear`` widens exactly: the
    same sums as :func:`pack_float`'s panels at half the bytes); None for any other weight.

    Where the CPU has no native bfloat16 the server computes in float32 (``dtype_choice``),
    and an F16 GGUF's matrices, read into float32, would otherwise be streamed at twice the
    bytes llama.cpp streams for the same file (docs/cpu-avx2.md)."""
    if weight.dim() != 2 or not is_exact_half(weight):
        return None
    return _panels(weight.to(torch.float16), int(weight.shape[0]))


@dataclass(frozen=True, slots=True)
class QuantizedPanels:
    """A :class:`QuantizedWeight` in panels: ``data`` int8 ``[P, K, 32]`` (8-bit) or uint8
    ``[P, K, 16]`` (4-bit; byte ``c`` holds column ``c`` in its low nibble and ``c + 16`` in
    its high one), ``scales``/``mins`` float16 ``[P, groups, 32]``; padded columns are zero."""

    data: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    out_features: int

    @staticmethod
    def supports(quant: QuantizedWeight) -> bool:
        """The kernel walks k in blocks of 32 under one scale: groups of a multiple of 32, or
        one group per row (per-channel int8)."""
        return quant.group % PANEL == 0 or quant.group == quant.in_features

    @classmethod
    def pack(cls, quant: QuantizedWeight) -> QuantizedPanels:
        n, k = quant.out_features, quant.in_features
        if quant.bits == 8:
            data = _panels(quant.data, n)
        else:
            low = (quant.data & 0x0F).view(n, k // 32, 16)
            high = (quant.data >> 4).view(n, k // 32, 16)
            q = _panels(torch.cat((low, high), dim=-1).reshape(n, k), n)  # [P, K, 32] 0..15
            data = (q[..., : PANEL // 2] | (q[..., PANEL // 2 :] << 4)).contiguous()
        mins = None if quant.mins is None else _panels(quant.mins, n)
        return cls(data, _panels(quant.scales, n), mins, quant.bits, quant.group, n)

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.nbytes
        return int(self.data.nbytes + self.scales.nbytes + mins)

    @property
    def fused_bits(self) -> int:
        """This layout's code in ``genserve::decode_layer``'s ``bits`` list."""
        return self.bits

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = torch.ops.genserve.qpanel_linear(
            x, self.data, self.scales, self.mins, self.bits, self.group, self.out_features, bias
        )
        return out

    def dequantize_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the matrix, dequantized as ``QuantizedWeight.dequantize`` does."""
        panel, col = ids // PANEL, ids % PANEL
        k, groups = self.in_features, self.scales.shape[1]
        if self.bits == 8:
            q = self.data[panel, :, col].to(torch.float32)  # [n, K]
        else:
            byte = self.data[panel, :, col % (PANEL // 2)]
            high = (col >= PANEL // 2)[:, None]
            q = torch.where(high, byte >> 4, byte & 0x0F).to(torch.float32)
        w = q.view(-1, groups, self.group) * self.scales[panel, :, col].to(torch.float32)[..., None]
        if self.mins is not None:
            w = w + self.mins[panel, :, col].to(torch.float32)[..., None]
        return w.reshape(-1, k).to(dtype)


def float_panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a float32 matrix packed by :func:`pack_float` or
    :func:`pack_half_exact`, as float32 (float16 panels widen exactly)."""
    return panels[ids // PANEL, :, ids % PANEL].to(torch.float32)
