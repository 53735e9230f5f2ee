"""Normalisation parts: RMSNorm (Llama), RMSNorm with ``(1 + w)`` (Gemma), LayerNorm with or
without bias (Phi-2, GPT-NeoX, StableLM, StarCoder2, Cohere), each over the last dimension.

All compute in float32 as transformers does.  Gemma's ``(1 + w)`` is folded into the stored
weight at load time (computed in float32, then cast), so one RMSNorm class and the CPU
``rms_norm`` ops serve both; in float32 this is exactly Gemma's ``x̂ * (1 + w)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genserve.kernels import fused_gpu_ops
from genserve.model.spec import NormKind, NormSpec
from genserve.model.weights import WeightSource


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _copy_in(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.copy_(loaded)


class RMSNorm(nn.Module):
    """RMS normalisation computed in float32 and cast back before the weight, as transformers
    does, so float32 and half-precision results match the reference bit for bit in layout."""

    # Set by the decoder's use_fused_cpu_ops: genserve's one-pass CPU op (same roundings).
    fused: bool = False
    # Set by the decoder's use_fused_gpu_ops: one Triton launch (kernels/fused_gpu_ops.py).
    gpu_fused: bool = False

    def __init__(
        self,
        size: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device,
        one_plus: bool = False,
    ) -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype, device=device)
        self.eps = eps
        self.shape = (size,)
        self.one_plus = one_plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, size].  F.rms_norm without weight computes exactly transformers'
        # x * rsqrt(mean(x^2) + eps) (checked bit for bit in float32) with one Python call
        # instead of five: Python dispatch, not arithmetic, is the cost at small batches.
        if self.fused:
            out: torch.Tensor = torch.ops.genserve.rms_norm(x, self.weight, self.eps)
            return out
        if self.gpu_fused:
            fused_out: torch.Tensor = fused_gpu_ops.rms_norm(x, self.weight, self.eps)
            return fused_out
        normed = F.rms_norm(x.float(), self.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, norm(x + residual))``: the residual add and the norm in one pass
        when fused."""
        if self.fused:
            summed, normed = torch.ops.genserve.add_rms_norm(x, residual, self.weight, self.eps)
            return summed, normed
        if self.gpu_fused:
            added: tuple[torch.Tensor, torch.Tensor] = fused_gpu_ops.add_rms_norm(
                x, residual, self.weight, self.eps
            )
            return added
        summed = residual + x
        return summed, self.forward(summed)

    def load(self, weights: WeightSource, name: str) -> None:
        loaded = weights.get(name)
        if self.one_plus:
            loaded = 1.0 + loaded.float()
        _copy_in(self.weight, loaded.reshape(self.shape), name)


class LayerNorm(nn.Module):
    """LayerNorm over the last ``len(shape)`` dimensions (a per-head norm has shape
    ``(num_heads, head_dim)`` with Cohere, normalising each head separately)."""

    fused: bool = False  # no CPU op: always torch

    def __init__(
        self,
        shape: tuple[int, ...],
        eps: float,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.eps = eps
        self.weight = _param(*shape, dtype=dtype, device=device)
        self.bias = _param(*shape, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.shape) == 1:
            bias = None if self.bias is None else self.bias.float()
            out: torch.Tensor = F.layer_norm(
                x.float(), self.shape, self.weight.float(), bias, self.eps
            )
            return out.to(x.dtype)
        # Per head with its own weights: normalise over head_dim, then scale per (head, dim).
        normed = F.layer_norm(x.float(), self.shape[-1:], None, None, self.eps)
        scaled = normed * self.weight.float()
        if self.bias is not None:
            scaled = scaled + self.bias.float()
        return scaled.to(x.dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return summed, self.forward(summed)

    def load(self, weights: WeightSource, name: str) -> None:
        _copy_in(self.weight, weights.get(name).reshape(self.shape), name)
        if self.bias is not None:
            bias_name = name.removesuffix(".weight") + ".bias"
            _copy_in(self.bias, weights.get(bias_name).reshape(self.shape), bias_name)


Norm = RMSNorm | LayerNorm


def make_norm(
    spec: NormSpec, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Norm:
    """The norm part ``spec`` describes, over ``shape`` (its last dimensions)."""
    if spec.kind is NormKind.LAYER:
        return LayerNorm(shape, spec.eps, spec.bias, dtype, device)
    if len(shape) != 1:
        raise ValueError("RMSNorm parts are over one dimension")
    return RMSNorm(shape[0], spec.eps, dtype, device, one_plus=spec.kind is NormKind.RMS_ONE_PLUS)
