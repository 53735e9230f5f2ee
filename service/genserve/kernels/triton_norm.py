"""RMSNorm, and the residual add fused into it, in Triton: one launch per call instead of the
four to six kernels torch's ops take (issue #29: a decoder layer's norms were ~8 of its ~19
kernels on the CUDA path).

What it computes is what :class:`genserve.model.norms.RMSNorm` computes eagerly, rounding
where torch rounds, so half-precision results agree with the eager path up to the order of
the float32 sum of squares (and the device's ``rsqrt``):

* ``add_rms_norm``: ``summed = round(x + residual)`` in the input dtype (torch's ``residual +
  x``), then the norm of ``summed``;
* norm: ``round(summed_f32 * rsqrt(mean(summed_f32²) + eps))`` to the input dtype, then
  ``round(that * weight)`` (transformers casts back before the weight).

One program per row (per row and head for a per-head q/k norm's ``[tokens, heads, head_dim]``
input); the whole row sits in registers (hidden sizes up to 16,384, as vLLM's
and SGLang's one-pass norms assume).  vLLM's ``fused_add_rms_norm`` writes both results in
place; these return new tensors, which inside a CUDA graph come from the graph's pool and
cost nothing, and keep the ops functional for ``torch.compile``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# The widest row one program handles (registers); wider rows are refused, not mis-computed.
MAX_HIDDEN = 16384


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(norm(s) * weight, s)`` with ``s = x + residual`` (``residual`` given) or ``s = x``
    (then the second result is None: nothing new to hand on).

    ``x``, ``residual``: ``[num_rows, hidden]``, or ``[num_rows, num_heads, hidden]`` (each
    head normalised on its own), with unit stride along ``hidden`` (any other strides);
    ``weight``: ``[hidden]``.  Outputs are contiguous, in ``x``'s dtype."""
    hidden = x.shape[-1]
    if x.dim() not in (2, 3) or (residual is not None and residual.shape != x.shape):
        raise ValueError("x must be [rows, hidden] or [rows, heads, hidden], residual alike")
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is wider than the Triton norm's {MAX_HIDDEN}")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rows must be contiguous")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = None if residual is None else torch.empty_like(out)
    if out.numel() == 0:
        return out, summed
    res = x if residual is None else residual
    res_out = out if summed is None else summed

    def strides(t: torch.Tensor) -> tuple[int, int]:  # (row, head); a 2-d tensor: one head
        return (t.stride(0), t.stride(1)) if t.dim() == 3 else (t.stride(0), 0)

    block = _next_pow2(hidden)
    _kernel()[(x.shape[0], x.shape[1] if x.dim() == 3 else 1)](
        x,
        res,
        weight,
        out,
        res_out,
        hidden,
        *strides(x),
        *strides(res),
        *strides(out),
        *strides(res_out),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, summed


@functools.cache
def _kernel() -> Any:
    """The ``@triton.jit`` function, defined on first use so that importing this module
    never imports Triton (and the interpreter switch is read when it is defined)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _rms_norm(  # type: ignore[no-untyped-def]
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        res_out_ptr,
        hidden,
        x_stride,
        x_head_stride,
        res_stride,
        res_head_stride,
        out_stride,
        out_head_stride,
        res_out_stride,
        res_out_head_stride,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < hidden
        x = tl.load(x_ptr + row * x_stride + head * x_head_stride + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r_at = res_ptr + row * res_stride + head * res_head_stride
            r = tl.load(r_at + cols, mask=mask, other=0.0)
            # Rounded to the input dtype first, as torch's ``residual + x`` is: the norm and
            # the next layer see the same summed values as the eager path.
            x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            s_at = res_out_ptr + row * res_out_stride + head * res_out_head_stride
            tl.store(s_at + cols, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / hidden
        normed = (xf * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        y = normed.to(tl.float32) * w.to(tl.float32)
        o_at = out_ptr + row * out_stride + head * out_head_stride
        tl.store(o_at + cols, y.to(out_ptr.dtype.element_ty), mask=mask)

    return _rms_norm
