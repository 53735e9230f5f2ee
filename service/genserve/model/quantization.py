"""Weight-only quantized matrices (``--quantize``): the storage format, quantizers from float
weights, and the torch reference that dequantizes.

Formats (``QuantizedWeight``), for a linear weight ``W [N, K]`` (``N`` output features):

* **8-bit**: ``data`` int8 ``[N, K]``, ``w = scale * q``.  ``--quantize int8`` uses one
  scale per output row (``group == K``, per-channel, what TGI/LoRAX call ``eetq`` on GPUs);
  GGUF ``Q8_0`` keeps its groups of 32.
* **4-bit**: ``data`` uint8 ``[N, K // 2]``, groups of 32 along ``K``, ``w = scale * q + min``
  with ``q`` in 0..15.  Within a group's 16 bytes, byte ``j`` holds ``q[j]`` in its low nibble
  and ``q[j + 16]`` in its high one: GGUF's Q4_0/Q4_1 order, so those blocks load without
  reshuffling and a kernel unpacks a group into two runs of consecutive weights.
  ``--quantize int4`` computes a scale and min per group (Q4_1's scheme); GGUF ``Q4_0``
  (``w = d * (q - 8)``) becomes ``min = -8 d``.

Scales and mins are float16, as in GGUF, so a loaded file keeps its exact values and bytes
per weight (8.5 bits for Q8_0, 5 for Q4_1).  Rows are independent, which is what tensor
parallelism (row shards) and the Q/K row permutation of GGUF files need (:meth:`rows`).

The fast path repacks a matrix into column panels (``model/weight_panels.py``) for
``genserve::qpanel_linear`` (``kernels/panel_gemm_cpu.cpp``); :meth:`QuantizedWeight.
dequantize` is the portable reference (CUDA, ``--disable-cpu-kernels``) that tests compare
the kernel against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

QuantizeMethod = Literal["int8", "int4", "gguf"]
# TGI/LoRAX name their weight-only int8 GPU method ``eetq``; on genserve it means int8.
QUANTIZE_ALIASES = {"eetq": "int8"}
GROUP_4BIT = 32


@dataclass(frozen=True, slots=True)
class MethodChoice:
    method: str | None  # int8 | int4 | gguf, or None: every matrix in the model dtype
    reason: str  # one line for the log


def choose_method(requested: str | None, from_gguf: bool, kernels: bool) -> MethodChoice:
    """The ``--quantize`` method served.  Unset, a model loaded from a ``.gguf`` file keeps
    its quantized blocks where genserve's CPU kernels run them (its Q8_0/Q4 values are what
    the float weights would be dequantized to, so the output is the same, at a fraction of
    the bytes per token); ``none`` serves the dequantized float weights instead."""
    if requested == "none":
        return MethodChoice(None, "--quantize none")
    if requested is not None:
        return MethodChoice(QUANTIZE_ALIASES.get(requested, requested), "--quantize")
    if from_gguf and kernels:
        return MethodChoice("gguf", "auto: a .gguf model keeps its quantized blocks on CPU")
    if from_gguf:
        return MethodChoice(None, "auto: GGUF blocks dequantized (no quantized kernels here)")
    return MethodChoice(None, "auto: the checkpoint's float weights")


class QuantizationError(ValueError):
    """A matrix cannot take the requested format (shape not a multiple of the group)."""


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    data: torch.Tensor  # int8 [N, K] (bits 8) or uint8 [N, K // 2] (bits 4)
    scales: torch.Tensor  # float16 [N, K // group]
    mins: torch.Tensor | None  # float16 [N, K // group], or None (symmetric: w = scale * q)
    bits: int  # 8 or 4
    group: int  # weights per scale along K (32, or K: one per row)

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1]) * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        mins = 0 if self.mins is None else self.mins.nbytes
        return int(self.data.nbytes + self.scales.nbytes + mins)

    def rows(self, index: torch.Tensor | slice) -> QuantizedWeight:
        """The matrix of the selected output rows (a permutation, a shard, looked-up ids)."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantizedWeight(
            self.data[index].contiguous(), self.scales[index].contiguous(), mins,
            self.bits, self.group,
        )  # fmt: skip

    def columns(self, start: int, stop: int) -> QuantizedWeight:
        """Input features ``[start, stop)`` (a row-parallel shard); whole groups only."""
        if (start, stop) == (0, self.in_features):
            return self
        if start % self.group or stop % self.group:
            raise QuantizationError(
                f"columns [{start}, {stop}) do not fall on groups of {self.group} weights"
            )
        per_byte = 2 if self.bits == 4 else 1
        g0, g1 = start // self.group, stop // self.group
        mins = None if self.mins is None else self.mins[:, g0:g1].contiguous()
        return QuantizedWeight(
            self.data[:, start // per_byte : stop // per_byte].contiguous(),
            self.scales[:, g0:g1].contiguous(), mins, self.bits, self.group,
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W [N, K]`` in ``dtype`` (computed in float32: ``scale * q (+ min)``)."""
        n, k = self.out_features, self.in_features
        if self.bits == 8:
            q = self.data.to(torch.float32).view(n, k // self.group, self.group)
        else:
            low = (self.data & 0x0F).view(n, k // 32, 16)
            high = (self.data >> 4).view(n, k // 32, 16)
            q = torch.cat((low, high), dim=-1).to(torch.float32)  # [n, groups, 32]
        w = q * self.scales.to(torch.float32)[..., None]
        if self.mins is not None:
            w = w + self.mins.to(torch.float32)[..., None]
        return w.view(n, k).to(dtype)

    def to(self, device: torch.device) -> QuantizedWeight:
        if self.data.device == device:
            return self  # a tied embedding and head keep sharing one object
        mins = None if self.mins is None else self.mins.to(device)
        return QuantizedWeight(
            self.data.to(device), self.scales.to(device), mins, self.bits, self.group
        )


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel int8: ``scale = max|w_row| / 127`` (rounded to float16
    first, so ``q`` is computed against the scale that is stored)."""
    w = weight.detach().to(torch.float32)
    absmax = w.abs().amax(dim=1, keepdim=True)
    scales = (absmax / 127.0).to(torch.float16)
    safe = torch.where(scales == 0, torch.ones_like(scales), scales).to(torch.float32)
    q = torch.round(w / safe).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scales.contiguous(), None, 8, int(w.shape[1]))


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """Asymmetric 4-bit in groups of 32 along the input features (GGUF Q4_1's scheme):
    ``scale = (max - min) / 15`` and ``min`` per group, both float16."""
    n, k = weight.shape
    if k % GROUP_4BIT:
        raise QuantizationError(
            f"4-bit quantization needs input features divisible by {GROUP_4BIT}, got {k}"
        )
    w = weight.detach().to(torch.float32).view(n, k // GROUP_4BIT, GROUP_4BIT)
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).to(torch.float16)
    mins = lo.to(torch.float16)
    d = scales.to(torch.float32)[..., None]
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round((w - mins.to(torch.float32)[..., None]) / safe).clamp_(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # [n, groups, 16]
    return QuantizedWeight(
        packed.reshape(n, k // 2).contiguous(), scales.contiguous(), mins.contiguous(), 4, 32
    )


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """``weight`` in the format ``method`` (int8 | int4) names."""
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight)
    raise QuantizationError(f"no quantizer for {method!r} (int8, int4)")


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack matrices of one format along the output features (fused Q/K/V, gate/up)."""
    first = parts[0]
    for part in parts[1:]:
        same = (part.bits, part.group, part.mins is None, part.in_features) == (
            first.bits, first.group, first.mins is None, first.in_features,
        )  # fmt: skip
        if not same:
            raise QuantizationError("fused matrices are stored in different formats")
    mins = None
    if first.mins is not None:
        mins = torch.cat([p.mins for p in parts if p.mins is not None])
    return QuantizedWeight(
        torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]), mins,
        first.bits, first.group,
    )  # fmt: skip
