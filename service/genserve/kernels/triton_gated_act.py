"""The gated MLP's activation in Triton: ``act(gate) * up`` from the merged ``[gate | up]``
projection in one launch (SiLU for Llama-like families, GELU-tanh for Gemma's GeGLU), where
torch takes a slice, the activation and a multiply (two to three kernels and a temporary).

Rounded as the eager ``F.silu(gate) * up`` / ``F.gelu(gate, approximate="tanh") * up`` are:
the activation is computed in float32 and rounded to the input dtype, then the product is
taken in float32 and rounded.  ``tanh`` is written through ``exp`` (Triton's core language
has no ``tanh``), which agrees with the library function to float32 rounding.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

ACTIVATIONS = ("silu", "gelu_tanh")
_BLOCK = 1024


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate_up[:, :n]) * gate_up[:, n:]`` → ``[num_rows, n]`` (``n`` = half the
    columns).  ``gate_up`` must have unit stride along its columns."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no fused kernel for activation {activation!r}")
    num_rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError("gate_up must be [rows, 2 * n] with contiguous rows")
    n = width // 2
    out = torch.empty((num_rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0 or n == 0:
        return out
    block = min(_BLOCK, 1 << max(0, (n - 1).bit_length()))
    _kernel()[(num_rows, -(-n // block))](
        gate_up,
        out,
        n,
        gate_up.stride(0),
        out.stride(0),
        GELU=activation == "gelu_tanh",
        BLOCK=block,
    )
    return out


@functools.cache
def _kernel() -> Any:
    """Defined on first use: importing this module never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _gated_act(  # type: ignore[no-untyped-def]
        in_ptr,
        out_ptr,
        n,
        in_stride,
        out_stride,
        GELU: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(in_ptr + row * in_stride + n + cols, mask=mask, other=0.0)
        if GELU:
            inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
            tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
            act = 0.5 * gate * (1.0 + tanh)
        else:
            act = gate / (1.0 + tl.exp(-gate))
        act = act.to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds the activation
        y = act * up.to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return _gated_act
