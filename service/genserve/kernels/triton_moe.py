"""The routed experts of a mixture-of-experts layer in Triton (the CUDA path of
``model/moe.py``): two grouped-GEMM launches over a step's (token, choice) pairs sorted by
expert, where the torch loop launches a handful of kernels per chosen expert and reads the
chosen experts back to the host (``torch.unique(...).tolist()``) to plan them.

The design is vLLM's ``fused_moe``, written for genserve's layouts:

1. :func:`align_by_expert` (torch ops on the device, no host synchronisation, fixed output
   sizes): the ``T·K`` pairs ``t·K + k`` are sorted by expert and each expert's run padded
   to a multiple of the tile height ``BM``, so every tile of ``BM`` sorted pairs belongs to
   one expert (``block_expert``); padding slots hold ``T·K`` (masked out) and tiles past
   the last expert's run hold expert ``E`` (they exit at once).  The sizes are the worst
   case (``T·K + min(E, T·K)·(BM - 1)`` slots), so a CUDA graph can capture the step.
2. Gate + up + activation (one launch, ``[tiles, ⌈L / BN⌉]`` programs): a program gathers
   its tile's token rows of ``x``, multiplies them by its expert's gate rows and up rows
   (``w13 [E, 2L, H]``: gate rows, then up rows) in two accumulators, adds the biases, and
   applies SiLU(gate)·up or gpt-oss's clamped SwiGLU; the result goes to row ``pair`` of
   ``act [T·K, L]``.
3. Down (one launch): ``act`` rows times the expert's ``w2 [E, H, L]`` (+ its bias),
   times the pair's routing weight, into row ``pair`` of ``[T·K, H]`` float32; the ``K``
   rows of a token are summed in float32 and rounded once (a per-token reduction).

Rounding follows the torch loop's points where it matters: the gate/up projections and the
down projection are rounded to the model dtype before the activation and before the
routing weight (as ``F.linear`` returns them); the activation is computed in float32 and
rounded once; float32 products use IEEE dots (never TF32), so float32 results equal the
loop's to summation order.  The one difference: the loop adds each expert's weighted rows
into the model-dtype output (one rounding per choice), this path rounds a token's sum once.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BN = 64
_BK = 32


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> str | None:
    """None when :func:`fused_experts` takes these operands, else why not (the caller runs
    the torch loop): a dtype other than float32/float16/bfloat16, operands that disagree on
    dtype or device, or strides other than contiguous rows."""
    if x.dtype not in DTYPES:
        return f"dtype {x.dtype}"
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        return "experts and activations in different dtypes"
    if w13.device != x.device or w2.device != x.device:
        return "experts and activations on different devices"
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        return "non-contiguous rows"
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[1] != 2 * w2.shape[2]:
        return "expert stacks not [E, 2L, H] and [E, H, L]"
    return None


def tile_height(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: 16 (the least a ``tl.dot`` takes) when a step gives each expert few
    pairs (decode), 64 when experts get many (prefill), where taller tiles reuse each weight
    tile over more rows."""
    return 64 if num_pairs >= 8 * num_experts else 16


def align_by_expert(
    ids: torch.Tensor, num_experts: int, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids [T, K]`` (int64, in ``[0, E)``) → ``(sorted_pairs, block_expert)``:
    ``sorted_pairs [T·K + min(E, T·K)·(block - 1)]`` int32, pair indices ``t·K + k`` grouped
    by expert in runs padded to multiples of ``block`` (padding ``T·K``), and
    ``block_expert [len(sorted_pairs) / block]`` int32, each tile's expert (``E``: unused).
    Device ops only, sizes fixed by the shapes (no host synchronisation)."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in pair order
    expert_of = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts, unpadded
    rank = torch.arange(num_pairs, device=device) - first[expert_of]
    slots = num_pairs + min(num_experts, num_pairs) * (block - 1)
    slots = (slots + block - 1) // block * block
    sorted_pairs = torch.full((slots,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, padded_start[expert_of] + rank, order.to(torch.int32))
    tile_starts = torch.arange(0, slots, block, device=device)
    block_expert = torch.searchsorted(padded_end, tile_starts, right=True)  # E past the end
    return sorted_pairs, block_expert.to(torch.int32)


def fused_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """``model.moe.experts_torch``'s contract in two Triton launches: ``x [T, H]``,
    ``ids``/``weights [T, K]`` (int64 / float32), ``w13 [E, 2L, H]``, ``w2 [E, H, L]``,
    optional biases ``b13 [E, 2L]``/``b2 [E, H]``, ``clamp`` = gpt-oss's ``(alpha, limit)``
    (None: SiLU-gated) → ``[T, H]`` in ``x``'s dtype.  Check :func:`supports` first."""
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, width = w13.shape[0], w2.shape[2]
    out = torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out
    block = tile_height(num_pairs, num_experts)
    sorted_pairs, block_expert = align_by_expert(ids, num_experts, block)
    tiles = block_expert.numel()
    x = x.contiguous()
    act = torch.empty((num_pairs, width), dtype=x.dtype, device=x.device)
    ieee = "ieee"  # float32 operands: IEEE products, as torch's (TF32 would round them)
    # Triton's interpreter multiplies 16-bit tiles wrongly (checked: a bfloat16 tl.dot is off
    # by ~1e10 under TRITON_INTERPRET=1, Triton 3.9); there the tiles go to float32 first,
    # which gives the same sums (a product of two 16-bit floats is exact in float32, and the
    # GPU's tensor cores accumulate 16-bit products in float32 too).
    upcast = x.dtype != torch.float32 and os.environ.get("TRITON_INTERPRET") == "1"
    dummy = w13  # a pointer for the absent biases (never read: HAS_BIAS is False)
    kernels = _kernels()
    kernels[0][(tiles, -(-width // _BN))](
        x, w13, dummy if b13 is None else b13, act, sorted_pairs, block_expert,
        num_pairs, top_k, hidden, width, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        0 if b13 is None else b13.stride(0),
        0.0 if clamp is None else clamp[0], 0.0 if clamp is None else clamp[1],
        HAS_BIAS=b13 is not None, CLAMPED=clamp is not None, PRECISION=ieee, UPCAST=upcast,
        BM=block, BN=_BN, BK=_BK,
    )  # fmt: skip
    pair_out = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    routing = weights.reshape(-1).to(torch.float32).contiguous()
    kernels[1][(tiles, -(-hidden // _BN))](
        act, w2, dummy if b2 is None else b2, routing, pair_out, sorted_pairs, block_expert,
        num_pairs, hidden, width, num_experts,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        0 if b2 is None else b2.stride(0),
        HAS_BIAS=b2 is not None, PRECISION=ieee, UPCAST=upcast, BM=block, BN=_BN, BK=_BK,
    )  # fmt: skip
    # [T, K, H] → [T, H]: a token's choices summed in float32, rounded once.
    out.copy_(pair_out.view(num_tokens, top_k, hidden).sum(dim=1))
    return out


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Defined on first use: importing this module never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _gate_up_act(  # type: ignore[no-untyped-def]
        x_ptr, w_ptr, b_ptr, act_ptr, pairs_ptr, block_expert_ptr,
        num_pairs, top_k, hidden, width, num_experts,
        stride_x, stride_we, stride_wn, stride_act, stride_be,
        alpha, limit,
        HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, PRECISION: tl.constexpr,
        UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        expert = tl.load(block_expert_ptr + tile).to(tl.int64)
        if expert >= num_experts:  # past the last expert's run
            return
        pair = tl.load(pairs_ptr + tile * BM + tl.arange(0, BM))  # [BM]
        valid = pair < num_pairs
        token = (pair // top_k).to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] of the expert width
        col_ok = cols < width
        w_base = w_ptr + expert * stride_we
        acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, hidden, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < hidden
            a = tl.load(
                x_ptr + token[:, None] * stride_x + ks[None, :],
                mask=valid[:, None] & k_ok[None, :], other=0.0,
            )  # fmt: skip
            w_mask = k_ok[:, None] & col_ok[None, :]
            gate_w = tl.load(
                w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0
            )
            up_w = tl.load(
                w_base + (cols[None, :] + width) * stride_wn + ks[:, None], mask=w_mask, other=0.0
            )  # fmt: skip
            if UPCAST:
                a, gate_w, up_w = a.to(tl.float32), gate_w.to(tl.float32), up_w.to(tl.float32)
            acc_gate += tl.dot(a, gate_w, input_precision=PRECISION)
            acc_up += tl.dot(a, up_w, input_precision=PRECISION)
        if HAS_BIAS:
            b_base = b_ptr + expert * stride_be
            acc_gate += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(b_base + width + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        # F.linear returns the projections in the model dtype: round them as it does.
        out_ty = act_ptr.dtype.element_ty
        gate = acc_gate.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        if CLAMPED:  # gpt-oss: (clamp(up) + 1) · g · sigmoid(alpha·g), g = min(gate, limit)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            y = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
        else:
            y = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(
            act_ptr + pair.to(tl.int64)[:, None] * stride_act + cols[None, :],
            y.to(out_ty), mask=valid[:, None] & col_ok[None, :],
        )  # fmt: skip

    @triton.jit  # type: ignore[untyped-decorator]
    def _down(  # type: ignore[no-untyped-def]
        act_ptr, w_ptr, b_ptr, routing_ptr, out_ptr, pairs_ptr, block_expert_ptr,
        num_pairs, hidden, width, num_experts,
        stride_act, stride_we, stride_wn, stride_out, stride_be,
        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        expert = tl.load(block_expert_ptr + tile).to(tl.int64)
        if expert >= num_experts:
            return
        pair = tl.load(pairs_ptr + tile * BM + tl.arange(0, BM))
        valid = pair < num_pairs
        row = pair.to(tl.int64)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)  # [BN] of the hidden size
        col_ok = cols < hidden
        w_base = w_ptr + expert * stride_we
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, width, BK):
            ks = k0 + tl.arange(0, BK)
            k_ok = ks < width
            a = tl.load(
                act_ptr + row[:, None] * stride_act + ks[None, :],
                mask=valid[:, None] & k_ok[None, :], other=0.0,
            )  # fmt: skip
            w = tl.load(
                w_base + cols[None, :] * stride_wn + ks[:, None],
                mask=k_ok[:, None] & col_ok[None, :], other=0.0,
            )  # fmt: skip
            if UPCAST:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(a, w, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert * stride_be + cols, mask=col_ok, other=0.0).to(
                tl.float32
            )[None, :]
        y = acc.to(act_ptr.dtype.element_ty).to(tl.float32)  # F.linear's rounding
        scale = tl.load(routing_ptr + row, mask=valid, other=0.0)
        tl.store(
            out_ptr + row[:, None] * stride_out + cols[None, :],
            y * scale[:, None], mask=valid[:, None] & col_ok[None, :],
        )  # fmt: skip

    return _gate_up_act, _down
