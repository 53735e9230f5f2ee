"""Paged attention for a whole step's rows in one Triton launch: decode rows, fresh prompts
and chunks continuing from the cache alike (issue #29, "unified" attention as vLLM's
``triton_unified_attention`` and SGLang's ``extend_attention`` do it).

Why: a step that carries prompt rows runs eagerly on CUDA, and there SDPA cost host time per
call and per shape (one call per prompt batch and per continuing chunk, per layer; on the
GPU machine most of the step thread's time).  Here the step's rows are described once per
step (query start offsets, context lengths, block tables: :class:`VarlenBatch`) and each
layer makes one launch that reads K/V in place through the block tables.  The K/V of this
step are already in the cache (the fused rotary + store runs first), so a fresh prompt is
a chunk that starts at position 0 and a decode row a chunk of one token: one case.

Grid: ``(tiles, num_kv_heads)``.  A tile is ``BLOCK_Q`` consecutive queries of one sequence
times the ``GROUP`` query heads sharing a KV head, ``BLOCK_M = BLOCK_Q * GROUP`` rows (at
least 16, for ``tl.dot``); a KV head's blocks are read once for all of its query heads.
Sequence ``s`` owns tiles ``qs[s] // BLOCK_Q + s ..``, so a program finds its sequence by a
binary search over the query start offsets and the grid's size, ``tokens // BLOCK_Q +
seqs``, is known on the host without reading anything back (vLLM's scheme); the few tiles
past a sequence's last query return at once.  Each program walks the cache blocks from the
window's start to its last query's position with an online softmax in float32: causal
(key position <= query position), sliding window (``q_pos - k_pos < window``), soft-capping
(``cap * tanh(s / cap)``) and attention sinks (one more logit per head in the denominator,
whose value is zero: the running max and sum start at the sink) are masks and two scalars.

Precision as in :mod:`genserve.kernels.triton_attention`: operands widened to float32 in
registers, IEEE products for float32 inputs (float32 greedy output stays comparable with
transformers), TF32 for bf16/fp16 inputs (exact for their values; the probabilities are
rounded to TF32 for the second product).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from genserve.kernels.triton_attention import available, supports

__all__ = ["VarlenBatch", "available", "paged_varlen_attention", "supports", "tile_rows"]

_MIN_DOT = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tile_rows(group: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_Q)`` for ``group`` query heads per KV head: the fewest rows a
    ``tl.dot`` takes (16) or the group rounded up to a power of two, and the queries that
    fit (a decode row fills ``group`` of them, as the decode kernel's padded group does)."""
    block_m = max(_MIN_DOT, _next_pow2(group))
    return block_m, max(1, block_m // group)


@dataclass(frozen=True, slots=True)
class VarlenBatch:
    """A step's rows for :func:`paged_varlen_attention`, built once per step (device
    tensors, views of one upload).

    ``query_start``: ``[num_seqs + 1]`` int, sequence ``s``'s queries are flat rows
    ``query_start[s] .. query_start[s + 1]``; ``seq_lens``: ``[num_seqs]`` int, its context
    length once this step's tokens are stored (its queries sit at the last positions);
    ``block_table``: ``[num_seqs, max_blocks]`` int (entries past a context never read).
    ``num_tokens`` and ``num_seqs`` are host integers (the launch grid)."""

    query_start: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_tokens: int
    num_seqs: int


def paged_varlen_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every query row of a step over its sequence's paged context.

    q: ``[num_tokens, num_heads, head_dim]`` (rows laid out as ``batch.query_start`` says);
    kv_cache: ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` holding this step's
    K/V already.  ``window``: keys with ``q_pos - k_pos < window`` only (HF's sliding
    window), None for all; ``softcap``: scores become ``softcap * tanh(score / softcap)``;
    ``sinks``: float ``[num_heads]`` sink logits.  Returns ``[num_tokens, num_heads,
    head_dim]`` in ``q``'s dtype."""
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError("q and kv_cache disagree on head_dim or the KV grouping")
    if num_tokens != batch.num_tokens:
        raise ValueError(f"q has {num_tokens} rows, the batch describes {batch.num_tokens}")
    group = num_heads // num_kv_heads
    # Contiguous whatever q's strides (q is usually a view of the fused QK projection).
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    block_m, block_q = tile_rows(group)
    tiles = num_tokens // block_q + batch.num_seqs
    sink_arg = sinks if sinks is not None else q  # never read without USE_SINKS
    _kernel()[(tiles, num_kv_heads)](
        q,
        kv_cache,
        batch.block_table,
        batch.query_start,
        batch.seq_lens,
        sink_arg,
        out,
        scale,
        window if window is not None else 0,
        softcap if softcap is not None else 1.0,
        batch.num_seqs,
        q.stride(0),
        q.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        batch.block_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(_MIN_DOT, _next_pow2(head_dim)),
        BLOCK_SIZE=block_size,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
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
    def _paged_varlen(  # type: ignore[no-untyped-def]
        q_ptr,
        cache_ptr,
        table_ptr,
        qstart_ptr,
        lens_ptr,
        sinks_ptr,
        out_ptr,
        scale,
        window,
        softcap,
        num_seqs,
        q_stride_tok,
        q_stride_head,
        c_stride_kv,
        c_stride_head,
        c_stride_block,
        c_stride_slot,
        t_stride_seq,
        o_stride_tok,
        o_stride_head,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        USE_SINKS: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        # The sequence owning this tile: the last s with qs[s] // BLOCK_Q + s <= tile.
        # Annotated: the loop-carried bounds keep one type even where Triton specialises
        # num_seqs == 1 to a constant.
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first_tile = tl.load(qstart_ptr + mid).to(tl.int32) // BLOCK_Q + mid
            lo = tl.where(first_tile <= tile, mid, lo)
            hi = tl.where(first_tile <= tile, hi, mid - 1)
        seq = lo
        q_begin = tl.load(qstart_ptr + seq).to(tl.int32)
        q_len = tl.load(qstart_ptr + seq + 1).to(tl.int32) - q_begin
        q_off = (tile - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
        if q_off >= q_len:  # a spare tile past this sequence's queries
            return
        seq_len = tl.load(lens_ptr + seq).to(tl.int32)
        start_pos = seq_len - q_len  # position of the sequence's first query

        rows = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM_PAD)
        slots = tl.arange(0, BLOCK_SIZE)
        q_idx = q_off + rows // GROUP  # the row's query within its sequence
        heads = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
        dim_ok = dims < HEAD_DIM
        q_pos = start_pos + q_idx

        tok = (q_begin + q_idx).to(tl.int64)
        q_ptrs = q_ptr + tok[:, None] * q_stride_tok + heads[:, None] * q_stride_head
        io_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptrs + dims[None, :], mask=io_mask, other=0.0).to(tl.float32)

        # Keys this tile needs: up to its last query's position, from its first query's
        # window start.
        kv_end = tl.minimum(seq_len, start_pos + q_off + BLOCK_Q)
        first = 0
        if USE_WINDOW:
            first = tl.maximum(start_pos + q_off - window + 1, 0)
        if USE_SINKS:
            m_i = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)  # exp(sink - sink)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        # 64-bit: a KV head's offset in a large cache passes 2^31 elements.
        k_base = cache_ptr + kv_head.to(tl.int64) * c_stride_head
        v_base = k_base + c_stride_kv
        for b in range(first // BLOCK_SIZE, tl.cdiv(kv_end, BLOCK_SIZE)):
            block_id = tl.load(table_ptr + seq * t_stride_seq + b).to(tl.int64)
            k_pos = b * BLOCK_SIZE + slots
            in_range = (k_pos < kv_end) & (k_pos >= first)
            offs = block_id * c_stride_block + slots[:, None] * c_stride_slot + dims[None, :]
            load_mask = in_range[:, None] & dim_ok[None, :]
            k = tl.load(k_base + offs, mask=load_mask, other=0.0)  # [BLOCK_SIZE, HEAD_DIM_PAD]
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
            if USE_SOFTCAP:
                # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp overflows to inf).
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            allowed = (k_pos[None, :] <= q_pos[:, None]) & in_range[None, :] & row_ok[:, None]
            if USE_WINDOW:
                allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no key yet (window start, padding rows) keeps m = -inf:
            # subtract 0 instead, so its weights are exp(-inf) = 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs, mask=load_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PRECISION)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tok[:, None] * o_stride_tok + heads[:, None] * o_stride_head
        tl.store(o_ptrs + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=io_mask)

    return _paged_varlen
