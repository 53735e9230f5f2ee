"""Few-row matmuls ``y = x Wᵀ (+ b)`` on CUDA in Triton: one launch that streams ``W`` once.

A decode step of one to four rows reads every weight matrix once and does two FLOPs per weight
element a row, so its projections run at the GPU's memory bandwidth or not at all.  cuBLAS
picks split-K kernels for these shapes whose partial sums go through a reduction kernel of
their own, and reaches ~65% of the H200's bandwidth on an 8B model's QKV and O projections
against ~85% on the MLP's (docs/gpu-step.md, session 13's profile).  This kernel gives each
program ``BLOCK_N`` output features and the whole of ``K``: it loads ``[BLOCK_N, BLOCK_K]``
tiles of ``W`` (rows contiguous along ``K``, so each warp reads whole 16-byte vectors), sums
``x·w`` in float32, reduces along ``K`` per tile and writes each output once: no partial
sums in memory, no second launch.

Which shape takes this kernel and which tile is decided on the device at load, by timing
(``model/gpu_gemv_plan.py``): nothing here is tuned to one GPU.  The result is rounded once
to ``out``'s dtype (bfloat16 / float16, or float32 for the LM head's unrounded logits), as
cuBLAS's is; the order of the float32 sums differs from cuBLAS's, as cuBLAS's own differs
between its kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

# Rows one launch takes (a padded tile of 1, 2 or 4 rows); more go to cuBLAS's GEMM.
MAX_ROWS = 4


@dataclasses.dataclass(frozen=True)
class GemvTile:
    """A launch shape: output features per program, ``K`` elements per loaded tile, warps."""

    block_n: int
    block_k: int
    warps: int

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_k}/w{self.warps}"


# The candidates timed at load: 8-16 KB of W in flight per program and iteration, from few
# wide programs (many rows) to many narrow ones (long rows).
TILES = (
    GemvTile(8, 512, 4),
    GemvTile(16, 512, 8),
    GemvTile(4, 1024, 4),
    GemvTile(32, 256, 8),
)


def reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """What :func:`gemv` computes: float32 sums of the products, rounded once."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def padded_rows(rows: int) -> int:
    """The tile's row count for ``rows`` (1, 2 or 4)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, not {rows}")
    return 1 << (rows - 1).bit_length()


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tile: GemvTile,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x [rows, K] @ weight [N, K]ᵀ (+ bias [N])`` → ``[rows, N]`` in ``out_dtype``.

    ``weight`` must have unit stride along ``K`` (``x`` is copied where it has not);
    ``rows`` is 1 to :data:`MAX_ROWS`."""
    rows, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"x has {k} columns, weight {k_w}")
    if weight.stride(1) != 1:
        raise ValueError("weight needs unit stride along K")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, n), dtype=out_dtype, device=x.device)
    if n == 0:
        return out
    _kernel()[(-(-n // tile.block_n),)](
        x,
        weight,
        weight if bias is None else bias,  # an unused pointer where there is no bias
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        EVEN_K=k % tile.block_k == 0,
        ROWS=padded_rows(rows),
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.warps,
    )
    return out


@functools.cache
def _kernel() -> Any:
    """Defined on first use: importing this module never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _gemv(  # type: ignore[no-untyped-def]
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        rows,
        n,
        k,
        x_stride,
        w_stride,
        y_stride,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        feats = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        feat_ok = feats < n
        # Rows past the weight's end read its last row (their sums are never stored), so
        # full tiles load without a mask on the features.
        w_rows = w_ptr + tl.minimum(feats, n - 1).to(tl.int64)[:, None] * w_stride
        r = tl.arange(0, ROWS)
        row_ok = r < rows
        x_rows = x_ptr + tl.minimum(r, rows - 1)[:, None] * x_stride
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            kk = k0 + cols
            if EVEN_K:
                w = tl.load(w_rows + kk[None, :])
                xv = tl.load(x_rows + kk[None, :])
            else:
                k_ok = kk < k
                w = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
                xv = tl.load(x_rows + kk[None, :], mask=k_ok[None, :], other=0.0)
            prod = xv.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + feats, mask=feat_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + r[:, None] * y_stride + feats[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & feat_ok[None, :])

    return _gemv
