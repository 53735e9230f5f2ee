"""Paged decode attention in Triton: each decode token reads its K/V in place through its
block table (no gather copy of the context, no padding to the longest sequence).

Why Triton and not a library: flash-attn has no wheel on PyPI (source only, hours to build),
so genserve cannot count on it; FlashInfer's wheel is 62 MB and JIT-compiles CUDA at first
use.  Triton ships with CUDA builds of torch, compiles in seconds, and its interpreter
(``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors, which is how CI (no GPU) tests
it against the SDPA reference.  The kernel reads genserve's torch-backend cache layout
``[2, num_kv_heads, num_blocks, block_size, head_dim]`` unchanged, so prefill (SDPA) and
decode (this kernel) share one cache.

One program per (sequence, KV head): it loads the query heads of that KV group (padded to
16 rows so ``tl.dot`` applies), walks the sequence's blocks, and keeps an online (flash)
softmax in float32.  Decode is bound by reading the KV cache, and a KV head's blocks are
read once for all the query heads that share them (GQA).  Long contexts with few sequences
would gain from splitting the context across programs (flash-decoding); not done yet.

Products are taken in float32 registers: IEEE for float32 inputs (not TF32, so float32
greedy output stays comparable with transformers), TF32 for bf16/fp16 inputs, whose values
TF32 represents exactly.  (Triton's interpreter also miscomputes ``tl.dot`` on bf16
operands, so widening first keeps the CPU tests meaningful.)
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import itertools
import os
from typing import Any

import torch

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# ``tl.dot(..., input_precision=)`` (the kernel's IEEE/TF32 choice) appeared in Triton 3.0.
_MIN_TRITON = (3, 0)


def triton_version_ok(version: str) -> bool:
    """Whether a Triton version string (``"3.1.0"``, ``"3.0.0+git1234"``) is new enough."""
    parts = []
    for part in version.split("+")[0].split(".")[:2]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= _MIN_TRITON


@functools.cache
def _triton_installed_ok() -> bool:
    """Whether Triton >= 3.0 is installed.  Asked once: ``importlib.metadata.version`` reads
    and parses the package's METADATA file, and :func:`available` is asked before every
    fused op of every layer (on the GPU machine, uncached, that was most of an eager step)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path: trust it
        version = ".".join(map(str, _MIN_TRITON))
    return triton_version_ok(version)


def available(device: torch.device) -> bool:
    """Whether the kernel can run for tensors on ``device``: on CUDA with Triton >= 3.0
    installed, or anywhere under Triton's interpreter (tests)."""
    if not _triton_installed_ok():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda"


def supports(block_size: int, head_dim: int) -> bool:
    """Shapes the kernel handles: a power-of-two block size of at least 16 tokens (one
    ``tl.dot`` tile per block) and any head size up to 256."""
    return block_size >= _MIN_DOT and block_size & (block_size - 1) == 0 and head_dim <= 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: ``[num_seqs, num_heads, head_dim]``; kv_cache: ``[2, num_kv_heads, num_blocks,
    block_size, head_dim]``; block_table: ``[num_seqs, max_blocks]`` int (entries past a
    sequence's context are never read); context_lens: ``[num_seqs]`` int, the query sits at
    position ``context_len - 1``.  ``window``: keys with ``q_pos - k_pos < window`` only
    (HF's sliding window), None for all.  Returns ``[num_seqs, num_heads, head_dim]``.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError("q and kv_cache disagree on head_dim or the KV grouping")
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    kernel = _kernel()
    kernel[(num_seqs, num_kv_heads)](
        q,
        kv_cache,
        block_table,
        context_lens,
        out,
        scale,
        window if window is not None else 0,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        GROUP_PAD=max(_MIN_DOT, _next_pow2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(_MIN_DOT, _next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        USE_WINDOW=window is not None,
        # Operands are widened to float32 in registers.  TF32 products of bf16/fp16 values
        # are exact (their significands fit TF32's), so half precision loses nothing to
        # TF32; float32 inputs need IEEE to keep their full precision.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


@functools.cache
def _kernel() -> Any:
    """The ``@triton.jit`` function, defined on first use so that importing this module
    never imports Triton (CPU deployments may not have it)."""
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _paged_decode(  # type: ignore[no-untyped-def]
        q_ptr,
        cache_ptr,
        table_ptr,
        lens_ptr,
        out_ptr,
        scale,
        window,
        q_stride_seq,
        q_stride_head,
        c_stride_kv,
        c_stride_head,
        c_stride_block,
        c_stride_slot,
        t_stride_seq,
        o_stride_seq,
        o_stride_head,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        rows = tl.arange(0, GROUP_PAD)  # query heads of this KV group
        dims = tl.arange(0, HEAD_DIM_PAD)
        slots = tl.arange(0, BLOCK_SIZE)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM

        heads = kv_head * GROUP + rows
        q_ptrs = q_ptr + seq * q_stride_seq + heads[:, None] * q_stride_head + dims[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

        context_len = tl.load(lens_ptr + seq)
        q_pos = context_len - 1
        first = 0
        if USE_WINDOW:
            first = tl.maximum(q_pos - window + 1, 0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        # 64-bit: a layer's cache past 2**31 elements (a large GPU's KV pool) would wrap.
        k_base = cache_ptr + kv_head.to(tl.int64) * c_stride_head
        v_base = k_base + c_stride_kv.to(tl.int64)
        for b in range(first // BLOCK_SIZE, tl.cdiv(context_len, BLOCK_SIZE)):
            block_id = tl.load(table_ptr + seq * t_stride_seq + b).to(tl.int64)
            k_pos = b * BLOCK_SIZE + slots
            valid = (k_pos < context_len) & (k_pos >= first)
            offs = block_id * c_stride_block + slots[:, None] * c_stride_slot + dims[None, :]
            load_mask = valid[:, None] & dim_ok[None, :]
            k = tl.load(k_base + offs, mask=load_mask, other=0.0)  # [BLOCK_SIZE, HEAD_DIM_PAD]
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs, mask=load_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_ptrs = out_ptr + seq * o_stride_seq + heads[:, None] * o_stride_head + dims[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    return _paged_decode
