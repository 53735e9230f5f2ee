"""Paged attention: the KV cache is a pool of fixed-size blocks; each sequence reads its K/V
through its block table.

A step's flat token batch is ordered **decodes first** (sequences with one new token), then
prefill chunks.  The runner describes the sequences once per step (:class:`SeqSpec`); a
backend turns that into metadata tensors shared by every layer.  Each layer then

1. writes the step's new K/V into the cache with one ``index_copy_`` per tensor through the
   slot mapping (slot = ``block_id * block_size + offset``), and
2. attends: all decodes in one batched op, prefill chunks one call each.

Two backends:

- :class:`TorchPagedAttention` (CPU, or CUDA without flash-attn): cache per layer
  ``[2, num_kv_heads, num_blocks, block_size, head_dim]`` (K and V stacked, head-major, so
  that gathering a batch's blocks yields ``[heads, seqs, context, head_dim]`` with no
  transpose copy); ``F.scaled_dot_product_attention`` does the math.  On CPU (float32 or
  half precision), decodes instead go through genserve's C++ kernel
  (``genserve.kernels.paged_attention_cpu``), which reads K/V in place through the block
  table (no gather copy, no padding to the longest context) with a float32 softmax; it
  differs from SDPA only in the order of float32 sums.  On CUDA, decodes go through
  genserve's Triton kernel (``genserve.kernels.triton_attention``), which also reads the
  blocks in place.
- ``FlashPagedAttention`` (:mod:`genserve.model.flash_attention`; CUDA with ``flash_attn``,
  float16/bfloat16, and block size a multiple of 256, which its paged kernels require): cache
  per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` and one
  ``flash_attn_varlen_func`` call with ``block_table`` for the whole batch.

This module holds the contracts every backend implements (:class:`SeqSpec`,
:class:`AttentionMetadata`, :class:`AttentionBackend`, the slot mapping and block tables)
and the torch backend; :mod:`genserve.model.attention_backend` chooses one for a device.

Past the house's ~500 lines (about 570): :class:`TorchAttentionMetadata` holds the ways a
step's rows attend (decode kernels, SDPA per prompt or batched, pinned SDPA, the Triton varlen
launch), and they share its per-step state; split apart, one dataclass's methods would live in
several modules.  The numpy helpers and the contracts are the candidates to move first.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from genserve.kernels.triton_rotary_kv import HEADS_FIRST
from genserve.kernels.triton_varlen_attention import VarlenBatch
from genserve.model import sdpa_pinned
from genserve.model.prompt_batch import PromptBatch, attend_prompts, from_index, prompt_index
from genserve.model.step_upload import HostPack, Upload, default_upload

# Below this many decodes in a half-precision step, SDPA beats the two-matmul path.
_MIN_DECODES_FOR_MATMUL = 4

# How a step with prompt rows attends (``--gpu-prefill-attention``, resolved): SDPA as torch
# picks its backend, SDPA with flash/efficient pinned, or one Triton launch for every row.
PrefillAttention = Literal["sdpa", "sdpa-pinned", "triton"]
_NO_PIN = contextlib.nullcontext()


@dataclass(frozen=True, slots=True)
class SeqSpec:
    """One sequence of the step: ``num_tokens`` new tokens at positions ``start_pos ..``,
    its KV living in ``block_ids`` (at least ``ceil((start_pos + num_tokens) / block_size)``
    entries).  ``known_len``: the prompt's length, for the tokens of a prompt chunk (0: not
    known; this chunk's end stands for it)."""

    num_tokens: int
    start_pos: int
    block_ids: tuple[int, ...]
    known_len: int = 0

    @property
    def context_len(self) -> int:
        return self.start_pos + self.num_tokens

    @property
    def rotary_base(self) -> int:
        """The prompt length that length-dependent rotary (longrope, dynamic NTK) starts
        from: transformers prefills a prompt in one forward, so every chunk of a prompt
        rotates by the whole prompt's length, not by where the chunk happens to end."""
        return self.known_len or self.context_len

    @property
    def rotary_len(self) -> int:
        """A one-token row's length under length-dependent rotary (see :meth:`rotary_lens`)."""
        return max(self.rotary_base, self.context_len)

    def rotary_lens(self) -> np.ndarray:
        """``[num_tokens]`` int64: each token's length under length-dependent rotary, as one
        uninterrupted run computes it: a prompt token the whole prompt's, a later token (a
        preempted request's output computed again) its own position + 1, as when decoded."""
        ends = np.arange(self.start_pos + 1, self.context_len + 1, dtype=np.int64)
        return np.maximum(ends, self.rotary_base)


class AttentionMetadata(Protocol):
    """Per-step attention inputs, built once and used by every layer."""

    slots: torch.Tensor  # [num_tokens] int64: each token's cache slot

    @property
    def kv_layout(self) -> int:
        """The cache layout (``kernels/triton_rotary_kv``: ``HEADS_FIRST``,
        ``BLOCKS_FIRST``), for the fused GPU rotary + K/V store."""
        ...

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new ``k``, ``v`` (``[num_tokens, num_kv_heads, head_dim]``)."""
        ...

    @property
    def fused_kv_slots(self) -> torch.Tensor | None:
        """The step's cache slots when genserve's CPU ``rotary_write_kv`` may store K/V (this
        backend's layout on CPU with the kernels loaded), else None (call ``write_kv``)."""
        ...

    def sequence_lengths(self) -> torch.Tensor:
        """``[num_tokens]``: for each token, its sequence's length once this step is done
        (the context rotary kinds that depend on it see: dynamic NTK, longrope)."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q``: ``[num_tokens, num_heads, head_dim]`` → ``[num_tokens, num_heads *
        head_dim]``; ``k``/``v`` are this step's new keys/values (already in the cache).
        ``softcap``: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
        ``sinks``: float32 ``[num_heads]``, one more logit per head in each softmax's
        denominator, whose value is zero (gpt-oss's attention sinks)."""
        ...


class AttentionBackend(Protocol):
    name: str
    block_dim: int  # the dimension of a layer's cache tensor that indexes blocks

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]: ...

    def build(self, seqs: list[SeqSpec], num_decodes: int, block_size: int) -> AttentionMetadata:
        """``seqs[:num_decodes]`` have one token each; the flat batch follows ``seqs``."""
        ...


def slot_mapping(seqs: list[SeqSpec], num_decodes: int, block_size: int) -> np.ndarray:
    """Cache slot of every token of the flat batch, ``[num_tokens]`` int64."""
    slots: list[int] = []
    for seq in seqs[:num_decodes]:
        p = seq.start_pos
        slots.append(seq.block_ids[p // block_size] * block_size + p % block_size)
    parts = [np.asarray(slots, dtype=np.int64)]
    for seq in seqs[num_decodes:]:
        pos = np.arange(seq.start_pos, seq.context_len, dtype=np.int64)
        blocks = np.asarray(seq.block_ids, dtype=np.int64)[pos // block_size]
        parts.append(blocks * block_size + pos % block_size)
    return np.concatenate(parts)


def block_table(seqs: list[SeqSpec], block_size: int) -> tuple[np.ndarray, int]:
    """``[num_seqs, max_blocks]`` of the blocks covering each context (padded with block 0,
    always masked out) and ``max_blocks``."""
    needed = [-(-s.context_len // block_size) for s in seqs]
    max_blocks = max(needed, default=0)
    table = np.zeros((len(seqs), max_blocks), dtype=np.int64)
    for i, (seq, n) in enumerate(zip(seqs, needed, strict=True)):
        table[i, :n] = seq.block_ids[:n]
    return table, max_blocks


@dataclass(slots=True)
class _Prefill:
    token_start: int
    num_tokens: int
    start_pos: int
    block_ids: torch.Tensor  # [num_blocks_needed]
    rotary_base: int  # SeqSpec.rotary_base
    # Masks by sliding window (None: full causal); built on first use.
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """``[num_tokens, context_len]`` bool (True: attend), or None for "plain causal from
        position 0", which SDPA's ``is_causal`` handles without a mask."""
        if window not in self.masks:
            if self.start_pos == 0 and window is None:
                self.masks[window] = None
            else:
                q_pos = torch.arange(
                    self.start_pos, self.start_pos + self.num_tokens, device=device
                )
                k_pos = torch.arange(self.start_pos + self.num_tokens, device=device)
                allowed = k_pos[None, :] <= q_pos[:, None]
                if window is not None:
                    allowed &= k_pos[None, :] > q_pos[:, None] - window
                self.masks[window] = allowed
        return self.masks[window]


@dataclass(slots=True)
class TorchAttentionMetadata:
    slots: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_blocks: torch.Tensor  # [num_decodes * max_blocks] int64 (flattened block table)
    decode_max_blocks: int
    decode_positions: torch.Tensor  # [num_decodes] int64, position of each decode token
    decode_context_lens: torch.Tensor  # [num_decodes] int64, decode_positions + 1
    prefills: list[_Prefill]
    device: torch.device
    use_cpu_kernel: bool = False  # decodes through torch.ops.genserve.paged_decode_attention
    use_triton_decode: bool = False  # decodes through genserve.kernels.triton_attention
    dtype: torch.dtype | None = None
    # Whole prompts attended in one padded SDPA call (TorchPagedAttention: on CUDA).
    fresh: PromptBatch | None = None
    # Steps with prompt rows: "triton" attends every row in one launch through ``varlen``
    # (set then, for steps with prefills); "sdpa-pinned" fixes SDPA's backends.
    prefill_mode: PrefillAttention = "sdpa"
    varlen: VarlenBatch | None = None
    # [num_decodes] SeqSpec.rotary_len where a row's differs from its context (the per-token
    # rows of a prompt chunk under --deterministic); None: decode_context_lens.
    decode_rotary_lens: torch.Tensor | None = None
    _decode_masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = field(default_factory=dict)

    @property
    def fused_kv_slots(self) -> torch.Tensor | None:
        # The CPU kernels' layout is this one: [2, kv_heads, blocks, block_size, head_dim].
        return self.slots if self.use_cpu_kernel else None

    @property
    def kv_layout(self) -> int:
        return HEADS_FIRST

    def sequence_lengths(self) -> torch.Tensor:
        rows = self.decode_rotary_lens
        ends = [self.decode_context_lens if rows is None else rows]
        for p in self.prefills:
            first = p.start_pos + 1  # SeqSpec.rotary_lens, on the device
            ends.append(
                torch.arange(first, first + p.num_tokens, device=self.device).clamp_(
                    min=p.rotary_base
                )
            )
        return torch.cat(ends)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # kv_cache: [2, kv_heads, num_blocks, block_size, head_dim]; k, v: [T, kv_heads, hd]
        two, heads, num_blocks, block_size, head_dim = kv_cache.shape
        flat = kv_cache.view(two, heads, num_blocks * block_size, head_dim)
        flat[0].index_copy_(1, self.slots, k.transpose(0, 1))
        flat[1].index_copy_(1, self.slots, v.transpose(0, 1))

    def decode_mask(self, window: int | None, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The decodes' additive mask ``[1, num_decodes, 1, max_blocks * block_size]`` over
        their gathered blocks (built once per step and window; latent attention reads it)."""
        return self._decode_mask(window, block_size, dtype)

    def _decode_mask(self, window: int | None, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask ``[1, num_decodes, 1, max_blocks * block_size]``: 0 where the
        gathered slot is inside the context (and window), -inf elsewhere."""
        mask = self._decode_masks.get((window, dtype))
        if mask is None:
            k_pos = torch.arange(self.decode_max_blocks * block_size, device=self.device)
            q_pos = self.decode_positions[:, None]
            allowed = k_pos[None, :] <= q_pos
            if window is not None:
                allowed &= k_pos[None, :] > q_pos - window
            mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~allowed, float("-inf"))
            mask = mask[None, :, None, :]
            self._decode_masks[(window, dtype)] = mask
        return mask

    def _attend_decodes(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """All decode tokens in one batched op → ``[num_decodes, num_heads * head_dim]``."""
        d = self.num_decodes
        _, num_heads, head_dim = q.shape
        # The CPU kernel caps scores and adds sinks itself; the Triton one does neither:
        # soft-capped layers and layers with sinks take the gathered eager path there.
        if self.use_cpu_kernel:
            out: torch.Tensor = torch.ops.genserve.paged_decode_attention(
                q[:d],
                kv_cache,
                self.decode_blocks.view(d, self.decode_max_blocks),
                self.decode_context_lens,
                scale,
                -1 if window is None else window,
                0.0 if softcap is None else softcap,
                sinks,
            )
            return out.view(d, num_heads * head_dim)
        if self.use_triton_decode and softcap is None and sinks is None:
            from genserve.kernels import triton_attention

            out = triton_attention.paged_decode_attention(
                q[:d],
                kv_cache,
                self.decode_blocks.view(d, self.decode_max_blocks),
                self.decode_context_lens,
                scale,
                window,
            )
            return out.view(d, num_heads * head_dim)
        _, num_kv_heads, _, block_size, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        # Gather every decode's blocks: [2, kv_heads, d, max_blocks * block_size, hd].
        ctx = kv_cache.index_select(2, self.decode_blocks)
        ctx = ctx.view(2, num_kv_heads, d, self.decode_max_blocks * block_size, head_dim)
        # Fold the query heads of a KV group into the query-length axis:
        # [d, heads, hd] -> [kv_heads, d, group, hd]; one op over all (kv_head, seq) pairs.
        q_dec = q[:d].view(d, num_kv_heads, group, head_dim).transpose(0, 1)
        if softcap is not None or sinks is not None:
            mask = self._decode_mask(window, block_size, torch.float32)
            # Head kvh * group + g's sink, beside its scores [kvh, d, g, L].
            sink = None if sinks is None else sinks.view(num_kv_heads, 1, group, 1)
            o = eager_attention(q_dec, ctx[0], ctx[1], mask, scale, softcap, sink)
        elif q.dtype == torch.float32 or d < _MIN_DECODES_FOR_MATMUL:
            mask = self._decode_mask(window, block_size, q.dtype)
            o = F.scaled_dot_product_attention(q_dec, ctx[0], ctx[1], attn_mask=mask, scale=scale)
        else:
            # Half precision, many sequences: two batched matmuls with a float32 softmax
            # (transformers' "eager" attention) measured ~2x faster than SDPA's CPU kernel,
            # whose per-(head, sequence) tiles are tiny here (query length = group size).
            scores = torch.matmul(q_dec, ctx[0].transpose(-1, -2)).float()  # [kvh, d, g, L]
            scores.mul_(scale).add_(self._decode_mask(window, block_size, torch.float32))
            o = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), ctx[1])
        return o.transpose(0, 1).reshape(d, num_heads * head_dim)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[1]
        d = self.num_decodes
        if not self.prefills:  # decode-only step: no output buffer to assemble
            return self._attend_decodes(q, kv_cache, scale, window, softcap, sinks)
        if self.varlen is not None:  # every row of the step in one launch, K/V in the cache
            from genserve.kernels import triton_varlen_attention

            o_all = triton_varlen_attention.paged_varlen_attention(
                q, kv_cache, self.varlen, scale, window, softcap, sinks
            )
            return o_all.view(num_tokens, num_heads * head_dim)
        pinned = self.prefill_mode == "sdpa-pinned"
        out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
        if d:
            out[:d] = self._attend_decodes(q, kv_cache, scale, window, softcap, sinks)
        fresh = self.fresh if softcap is None and sinks is None and window is None else None
        if fresh is not None:
            attend_prompts(fresh, q, k, v, scale, out, pinned)
        for p in self.prefills:
            if fresh is not None and p.token_start in fresh.token_starts:
                continue
            s, n = p.token_start, p.num_tokens
            q_p = q[s : s + n].transpose(0, 1)[None]  # [1, heads, n, hd]
            prefill_mask = p.mask(window, self.device)
            if softcap is not None or sinks is not None:
                o = self._eager_prefill(p, q_p, k, v, kv_cache, scale, window, softcap, sinks)
            elif prefill_mask is None:  # whole prompt from position 0: attend to the fresh K/V
                k_p = k[s : s + n].transpose(0, 1)[None]
                v_p = v[s : s + n].transpose(0, 1)[None]
                if pinned:
                    k_p, v_p = (sdpa_pinned.expand_kv(x, num_heads) for x in (k_p, v_p))
                with sdpa_pinned.pinned(q.device, masked=False) if pinned else _NO_PIN:
                    o = F.scaled_dot_product_attention(
                        q_p, k_p, v_p, is_causal=True, scale=scale,
                        enable_gqa=k_p.shape[1] != num_heads,
                    )  # fmt: skip
            else:  # earlier positions are in the cache: read the context through the blocks
                ctx_len = p.start_pos + n
                ctx = kv_cache.index_select(2, p.block_ids)
                ctx = ctx.view(2, num_kv_heads, -1, head_dim)[:, :, :ctx_len]
                k_c, v_c = ctx[0][None], ctx[1][None]
                if pinned:
                    k_c, v_c = (sdpa_pinned.expand_kv(x, num_heads) for x in (k_c, v_c))
                with sdpa_pinned.pinned(q.device, masked=True) if pinned else _NO_PIN:
                    o = F.scaled_dot_product_attention(
                        q_p, k_c, v_c, attn_mask=prefill_mask, scale=scale,
                        enable_gqa=k_c.shape[1] != num_heads,
                    )  # fmt: skip
            out[s : s + n] = o[0].transpose(0, 1).reshape(n, num_heads * head_dim)
        return out

    def _eager_prefill(
        self,
        p: _Prefill,
        q_p: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """One prefill chunk through :func:`eager_attention` → ``[1, heads, n, head_dim]``."""
        _, num_heads, n, head_dim = q_p.shape
        num_kv_heads = kv_cache.shape[1]
        ctx_len = p.start_pos + n
        if p.start_pos == 0:  # the whole context is this step's K/V
            keys, values = (
                k[p.token_start : p.token_start + n],
                v[p.token_start : p.token_start + n],
            )
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [kvh, n, hd]
        else:
            ctx = kv_cache.index_select(2, p.block_ids)
            ctx = ctx.view(2, num_kv_heads, -1, head_dim)[:, :, :ctx_len]
            keys, values = ctx[0], ctx[1]
        q_pos = torch.arange(p.start_pos, ctx_len, device=self.device)
        k_pos = torch.arange(ctx_len, device=self.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=self.device)
        mask.masked_fill_(~allowed, float("-inf"))
        group = num_heads // num_kv_heads
        # [kvh, group * n, hd]: the query heads of a KV group share its keys.
        q_g = q_p[0].reshape(num_kv_heads, group, n, head_dim).reshape(num_kv_heads, group * n, -1)
        sink = None
        if sinks is not None:  # row g * n + i of KV head h is query head h * group + g's
            sink = sinks.view(num_kv_heads, group, 1).expand(num_kv_heads, group, n)
            sink = sink.reshape(num_kv_heads, group * n, 1)
        o = eager_attention(q_g, keys, values, mask.repeat(group, 1), scale, softcap, sink)
        return o.view(num_kv_heads, group, n, head_dim).reshape(1, num_heads, n, head_dim)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' eager attention with score soft-capping and/or attention sinks:
    ``softmax(cap * tanh(q kᵀ * scale / cap) + mask) v``, the softmax in float32, over one
    more column per row holding its sink logit (then dropped: the sink's value is zero).
    ``q`` ``[..., m, hd]``, ``k``/``v`` ``[..., L, hd]``, ``mask`` additive, broadcastable to
    ``[..., m, L]``, ``sinks`` broadcastable to ``[..., m, 1]``."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.float() + mask
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(q.dtype), v)


class TorchPagedAttention:
    """Portable backend built on ``F.scaled_dot_product_attention``."""

    block_dim = 2

    def __init__(
        self,
        device: torch.device,
        use_cpu_kernel: bool = False,
        use_triton_decode: bool = False,
        per_token: bool = False,
        batch_prompts: bool | None = None,
        prefill: PrefillAttention = "sdpa",
        upload: Upload | None = None,
    ) -> None:
        """``prefill``: how steps with prompt rows attend (``"triton"`` needs
        ``genserve.kernels.triton_varlen_attention`` to run for the cache's tensors: the
        caller checks).  ``upload``: how the step's metadata reaches the device (default:
        pinned + ``non_blocking`` on CUDA; the runner passes its ``DeviceIO``'s)."""
        self.device = device
        # Whole prompts of a step in one SDPA call (model/prompt_batch.py): on CUDA, where
        # the per-call host cost is what a step with many prompts pays; on CPU each prompt's
        # own call stays (no padding computed).
        self.batch_prompts = device.type == "cuda" if batch_prompts is None else batch_prompts
        self.use_cpu_kernel = use_cpu_kernel
        self.use_triton_decode = use_triton_decode
        self.prefill: PrefillAttention = prefill
        self.upload = upload if upload is not None else default_upload(device)
        # --deterministic (with the CPU kernel): every token of a prefill chunk is attended
        # as a decode of its own (its position, its context), so a token's attention is the
        # same sums whether it came alone, in a chunk of any size, or after a prefix-cache hit.
        self.per_token = per_token and use_cpu_kernel
        self.name = "torch-sdpa"
        if self.per_token:
            self.name = "cpu-kernel-per-token"
        elif use_cpu_kernel:
            self.name += "+cpu-decode-kernel"
        elif use_triton_decode:
            self.name += "+triton-decode"
        if prefill == "triton":
            self.name += "+triton-prefill"
        elif prefill == "sdpa-pinned":
            self.name += "+pinned-prefill"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_kv_heads, num_blocks, block_size, head_dim)

    def _whole_prompts(self, seqs: list[SeqSpec], num_decodes: int) -> list[tuple[int, int]]:
        """``(first flat row, tokens)`` of the step's prompts that start at position 0."""
        whole, row = [], num_decodes
        for seq in seqs[num_decodes:]:
            if seq.start_pos == 0:
                whole.append((row, seq.num_tokens))
            row += seq.num_tokens
        return whole

    def build(self, seqs: list[SeqSpec], num_decodes: int, block_size: int) -> AttentionMetadata:
        """Every array of the step's metadata is gathered on the host and sent in one
        asynchronous copy (``model/step_upload.py``): no blocking upload, no value read."""
        dev = self.device
        per_row_rotary = False  # rows whose rotary length is not their context's
        if self.per_token and num_decodes < len(seqs):
            # The flat batch is unchanged: decodes, then each chunk's tokens in order.
            seqs = [
                *seqs[:num_decodes],
                *(
                    SeqSpec(1, seq.start_pos + i, seq.block_ids, seq.rotary_base)
                    for seq in seqs[num_decodes:]
                    for i in range(seq.num_tokens)
                ),
            ]
            num_decodes = len(seqs)
            per_row_rotary = True
        has_prefills = num_decodes < len(seqs)
        table, max_blocks = block_table(seqs[:num_decodes], block_size)
        decode_positions = np.fromiter(
            (s.start_pos for s in seqs[:num_decodes]), dtype=np.int64, count=num_decodes
        )
        pack = HostPack()
        pack.add("slots", slot_mapping(seqs, num_decodes, block_size))
        pack.add("decode_blocks", table.reshape(-1))
        pack.add("decode_positions", decode_positions)
        pack.add("decode_context_lens", decode_positions + 1)  # once per step, not per layer
        if per_row_rotary:  # --deterministic's rows of a prompt chunk: the whole prompt's
            rotary = (s.rotary_len for s in seqs[:num_decodes])
            pack.add("decode_rotary_lens", np.fromiter(rotary, np.int64, count=num_decodes))
        for i, seq in enumerate(seqs[num_decodes:]):
            needed = -(-seq.context_len // block_size)
            pack.add(f"prefill{i}", np.asarray(seq.block_ids[:needed], dtype=np.int64))
        varlen = self.prefill == "triton" and has_prefills
        # The padded SDPA prompt batch, unless the Triton kernel attends every row.
        batched = self.batch_prompts and not varlen
        whole = self._whole_prompts(seqs, num_decodes) if batched else []
        index = prompt_index(whole) if whole else None
        if index is not None:
            pack.add("prompt_index", index)
        if varlen:
            query_lens = np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))
            pack.add("query_start", np.concatenate([[0], np.cumsum(query_lens)]))
            pack.add("seq_lens", np.fromiter((s.context_len for s in seqs), np.int64, len(seqs)))
            pack.add("block_table", block_table(seqs, block_size)[0])
        on_device = pack.upload(self.upload)

        prefills = []
        token_start = num_decodes
        for i, seq in enumerate(seqs[num_decodes:]):
            blocks = on_device[f"prefill{i}"]
            prefills.append(
                _Prefill(token_start, seq.num_tokens, seq.start_pos, blocks, seq.rotary_base)
            )
            token_start += seq.num_tokens
        return TorchAttentionMetadata(
            slots=on_device["slots"],
            num_decodes=num_decodes,
            decode_blocks=on_device["decode_blocks"],
            decode_max_blocks=max_blocks,
            decode_positions=on_device["decode_positions"],
            decode_context_lens=on_device["decode_context_lens"],
            decode_rotary_lens=on_device["decode_rotary_lens"] if per_row_rotary else None,
            prefills=prefills,
            device=dev,
            use_cpu_kernel=self.use_cpu_kernel,
            use_triton_decode=self.use_triton_decode,
            fresh=None if index is None else from_index(whole, on_device["prompt_index"]),
            prefill_mode=self.prefill,
            varlen=VarlenBatch(
                on_device["query_start"],
                on_device["seq_lens"],
                on_device["block_table"],
                token_start,
                len(seqs),
            )
            if varlen
            else None,
        )
