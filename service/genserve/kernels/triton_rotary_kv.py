"""Rotary position embedding fused with the paged KV store, in Triton: one launch rotates the
step's query and key heads in place and writes each token's (rotated) key and value into its
cache slot.  The eager path takes a flip, two multiplies and an add over Q and K, then two
``index_copy_`` kernels (issue #29); vLLM has ``rotary_embedding`` + ``reshape_and_cache_flash``
as two CUDA ops, SGLang and nano-vllm a Triton ``store_kvcache``; here they are one.

Angles come from a table of ``cos`` / ``sin`` halves ``[rows, head_dim / 2]``, in the model's
dtype:

* indexed by each token's position (``positions`` given): the table is computed once at load
  time for every position the server can reach (``RotaryEmbedding.half_table``);
* or one row per token (``positions`` None): angles that depend on more than the position
  (dynamic NTK, longrope) are computed per step and handed in.

Heads are "rotate half" over the whole head (partial and interleaved rotary are permuted into
that form at load time, with ``cos = 1, sin = 0`` on features that do not rotate; see
``model/rotary.py``).  Rounded as the eager ``x * cos + swapped * signed_sin`` is: each
product rounded to the dtype, then the sum.

One program per (token, head) over ``num_heads + 2 * num_kv_heads`` heads: query heads are
rotated, key heads rotated and stored, value heads stored.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# The KV cache layouts of genserve's attention backends (model/attention.py).
HEADS_FIRST = 0  # torch backend: [2, num_kv_heads, num_blocks, block_size, head_dim]
BLOCKS_FIRST = 1  # flash-attn: [2, num_blocks, block_size, num_kv_heads, head_dim]


def rotary_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: int,
) -> None:
    """Rotate ``qk`` ``[num_tokens, num_heads + num_kv_heads, head_dim]`` in place (its last
    ``num_kv_heads`` heads are the keys) and store keys and ``v`` ``[num_tokens, num_kv_heads,
    head_dim]`` at cache slot ``slots[t]`` (``block * block_size + offset``) of ``kv_cache``
    (``layout``: :data:`HEADS_FIRST` or :data:`BLOCKS_FIRST`).

    ``cos``/``sin``: ``[rows, head_dim / 2]`` halves (unsigned ``sin``), row
    ``positions[t]`` for token ``t``, or row ``t`` when ``positions`` is None; both None: no
    rotation (a no-rope layer), the store only.  Head features must be contiguous."""
    num_tokens, num_qk, head_dim = qk.shape
    num_kv_heads = v.shape[1]
    if head_dim % 2 or v.shape[2] != head_dim or qk.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("qk and v must have the same even head size with contiguous features")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin go together")
    if layout == HEADS_FIRST:
        _, cache_heads, _, block_size, cache_dim = kv_cache.shape
        s_kv, s_head, s_block, s_slot = (kv_cache.stride(i) for i in range(4))
    elif layout == BLOCKS_FIRST:
        _, _, block_size, cache_heads, cache_dim = kv_cache.shape
        s_kv, s_block, s_slot, s_head = (kv_cache.stride(i) for i in range(4))
    else:
        raise ValueError(f"unknown KV cache layout {layout}")
    if cache_heads != num_kv_heads or cache_dim != head_dim or kv_cache.stride(4) != 1:
        raise ValueError("the KV cache does not match the heads being stored")
    if num_tokens == 0:
        return
    half = head_dim // 2
    num_heads = num_qk - num_kv_heads
    table_cos = qk if cos is None else cos  # unused pointers when nothing rotates
    table_sin = qk if sin is None else sin
    _kernel()[(num_tokens, num_qk + num_kv_heads)](
        qk,
        v,
        table_cos,
        table_sin,
        slots if positions is None else positions,
        slots,
        kv_cache,
        qk.stride(0),
        qk.stride(1),
        v.stride(0),
        v.stride(1),
        table_cos.stride(0),
        table_sin.stride(0),
        s_kv,
        s_head,
        s_block,
        s_slot,
        block_size,
        num_heads,
        num_kv_heads,
        HALF=half,
        HALF_PAD=1 << max(0, (half - 1).bit_length()),
        ROTATE=cos is not None,
        BY_POSITION=positions is not None,
    )


@functools.cache
def _kernel() -> Any:
    """Defined on first use: importing this module never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _rotary_kv(  # type: ignore[no-untyped-def]
        qk_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        cache_ptr,
        qk_stride_tok,
        qk_stride_head,
        v_stride_tok,
        v_stride_head,
        cos_stride,
        sin_stride,
        c_stride_kv,
        c_stride_head,
        c_stride_block,
        c_stride_slot,
        block_size,
        num_heads,
        num_kv_heads,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        ROTATE: tl.constexpr,
        BY_POSITION: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dims = tl.arange(0, HALF_PAD)
        mask = dims < HALF
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        block = slot // block_size
        offset = slot % block_size
        if head < num_heads + num_kv_heads:
            src = qk_ptr + tok * qk_stride_tok + head * qk_stride_head
            x1 = tl.load(src + dims, mask=mask, other=0.0)
            x2 = tl.load(src + HALF + dims, mask=mask, other=0.0)
            if ROTATE:
                if BY_POSITION:  # noqa: SIM108 (a constexpr branch, kept explicit)
                    row = tl.load(pos_ptr + tok).to(tl.int64)
                else:
                    row = tok
                c = tl.load(cos_ptr + row * cos_stride + dims, mask=mask, other=1.0)
                s = tl.load(sin_ptr + row * sin_stride + dims, mask=mask, other=0.0)
                c = c.to(tl.float32)
                s = s.to(tl.float32)
                dt = qk_ptr.dtype.element_ty
                a1 = x1.to(tl.float32)
                a2 = x2.to(tl.float32)
                # Each product rounded to the dtype, then the sum: the eager op order.
                o1 = (a1 * c).to(dt).to(tl.float32) - (a2 * s).to(dt).to(tl.float32)
                o2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
                x1 = o1.to(dt)
                x2 = o2.to(dt)
                tl.store(src + dims, x1, mask=mask)
                tl.store(src + HALF + dims, x2, mask=mask)
            if head >= num_heads:  # a key head: into the K half of the cache
                kv_head = head - num_heads
                dst = (
                    cache_ptr
                    + kv_head * c_stride_head
                    + block * c_stride_block
                    + offset * c_stride_slot
                )
                tl.store(dst + dims, x1.to(cache_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + HALF + dims, x2.to(cache_ptr.dtype.element_ty), mask=mask)
        else:  # a value head: copied into the V half
            kv_head = head - num_heads - num_kv_heads
            src = v_ptr + tok * v_stride_tok + kv_head * v_stride_head
            dst = (
                cache_ptr
                + c_stride_kv
                + kv_head * c_stride_head
                + block * c_stride_block
                + offset * c_stride_slot
            )
            y1 = tl.load(src + dims, mask=mask, other=0.0)
            y2 = tl.load(src + HALF + dims, mask=mask, other=0.0)
            tl.store(dst + dims, y1.to(cache_ptr.dtype.element_ty), mask=mask)
            tl.store(dst + HALF + dims, y2.to(cache_ptr.dtype.element_ty), mask=mask)

    return _rotary_kv
