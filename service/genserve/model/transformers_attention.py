"""genserve's paged KV cache behind transformers' attention interface.

transformers' modeling classes compute Q/K/V, rotary, q/k norms and so on, then call
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
attention_mask, scaling=..., sliding_window=..., softcap=..., s_aux=..., ...)``.
:func:`paged_attention`, registered as ``"genserve_paged"``, is that function for the
fallback (as vLLM's Transformers backend registers its own): it

1. stores the step's new K/V into the layer's blocks of genserve's cache (through the step's
   slot mapping), and
2. attends every query row over its own sequence's context, read through that sequence's
   block table (decode rows batched, each prefill chunk on its own), with the options the
   layer passed: scale, sliding window, soft-capping, attention sinks (gpt-oss ``s_aux``),
   grouped-query heads, chunked attention (Llama-4's ``chunked_attention`` layers, whose
   chunk size only the mask carries, read from the module's config).

The step is one flat batch (``[1, num_tokens]``, decodes first, as the runner orders it), so
no transformers mask is built: the mask interface has no entry for this name, which makes
``create_causal_mask`` return None, and each sequence's causal mask is made here from its
positions.

The step's metadata and caches are bound with :func:`bind_step` around the forward (a
context variable: the forward runs on one thread).  A layer's K and V may have different
widths (DeepSeek's latent attention: K 192, V 128) and layers different KV head counts
(Gemma 4): the cache is sized for the widest, and a layer uses the leading heads and
channels.  Where a layer fits the cache exactly and has no soft-cap, sink or chunk, the
native backend's ``attend`` runs it (genserve's CPU decode kernel included).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from genserve.model.attention import TorchAttentionMetadata

ATTENTION_NAME = "genserve_paged"


@dataclass(frozen=True, slots=True)
class PagedStep:
    """What every layer of one forward needs: the step's attention metadata, the per-layer
    caches (``[2, kv_heads, num_blocks, block_size, head_dim]`` each) and which cache each
    transformers ``layer_idx`` uses."""

    meta: TorchAttentionMetadata
    kv_caches: Sequence[torch.Tensor]
    cache_index: Mapping[int, int]


_STEP: contextvars.ContextVar[PagedStep | None] = contextvars.ContextVar(
    "genserve_paged_step", default=None
)


@contextmanager
def bind_step(step: PagedStep) -> Iterator[None]:
    """Make ``step`` the one :func:`paged_attention` serves while the block runs."""
    token = _STEP.set(step)
    try:
        yield
    finally:
        _STEP.reset(token)


def register() -> None:
    """Register :func:`paged_attention` under ``"genserve_paged"`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, num_kv_heads, num_tokens, k_dim]
    value: torch.Tensor,  # [1, num_kv_heads, num_tokens, v_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract → ``([1, num_tokens, num_heads, v_dim],
    None)``; see the module docstring."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("genserve_paged attention called outside a genserve step")
    if kwargs.get("is_causal") is False:
        raise RuntimeError("genserve_paged attention serves causal self-attention only")
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None or int(layer_idx) not in step.cache_index:
        raise RuntimeError(f"{type(module).__name__} has no KV cache layer (layer_idx)")
    cache = step.kv_caches[step.cache_index[int(layer_idx)]]
    q = query[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    k = key[0].transpose(0, 1)  # [num_tokens, num_kv_heads, k_dim]
    v = value[0].transpose(0, 1)  # [num_tokens, num_kv_heads, v_dim]
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    window = int(sliding_window) if sliding_window else None
    chunk = _attention_chunk(module, int(layer_idx))
    sinks = s_aux if s_aux is not None else kwargs.get("sinks")
    out = attend(step.meta, cache, q, k, v, scale, window, chunk, softcap, sinks)
    return out[None], None


def _attention_chunk(module: torch.nn.Module, layer_idx: int) -> int | None:
    """Llama-4's chunked layers: attend within ``attention_chunk_size`` aligned chunks."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_idx >= len(layer_types):
        return None
    if layer_types[layer_idx] != "chunked_attention":
        return None
    size = getattr(config, "attention_chunk_size", None)
    return int(size) if size else None


def attend(
    meta: TorchAttentionMetadata,
    cache: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    chunk: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store ``k``/``v`` in ``cache`` and attend → ``[num_tokens, num_heads, v_dim]``."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads, k_dim, v_dim = k.shape[1], k.shape[2], v.shape[2]
    _, cache_heads, num_blocks, block_size, cache_dim = cache.shape
    plain = softcap is None and sinks is None and chunk is None
    if plain and cache_heads == num_kv_heads and k_dim == v_dim == cache_dim:
        meta.write_kv(cache, k, v)
        return meta.attend(q, k, v, cache, scale, window).view(num_tokens, num_heads, v_dim)
    flat = cache.view(2, cache_heads, num_blocks * block_size, cache_dim)
    flat[0, :num_kv_heads, meta.slots, :k_dim] = k.transpose(0, 1).to(cache.dtype)
    flat[1, :num_kv_heads, meta.slots, :v_dim] = v.transpose(0, 1).to(cache.dtype)
    layer_cache = cache[:, :num_kv_heads]  # [2, kv_heads, num_blocks, block_size, cache_dim]
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
    opts = _Options(scale, window, chunk, softcap, sinks)
    d = meta.num_decodes
    if d:
        length = meta.decode_max_blocks * block_size
        ctx = layer_cache.index_select(2, meta.decode_blocks)
        ctx = ctx.view(2, num_kv_heads, d, length, cache_dim).transpose(1, 2)
        positions = meta.decode_positions[:, None, None]  # [d, 1 (query), 1]
        allowed = _allowed(positions, torch.arange(length, device=q.device), opts)
        o = _softmax_attention(
            q[:d, :, None, :], ctx[0, ..., :k_dim], ctx[1, ..., :v_dim], allowed, opts
        )  # [d, heads, 1, v_dim]
        out[:d] = o[:, :, 0]
    for p in meta.prefills:
        s, n = p.token_start, p.num_tokens
        ctx_len = p.start_pos + n
        ctx = layer_cache.index_select(2, p.block_ids).view(2, num_kv_heads, -1, cache_dim)
        ctx = ctx[:, None, :, :ctx_len]  # [2, 1, kv_heads, ctx_len, cache_dim]
        q_pos = torch.arange(p.start_pos, ctx_len, device=q.device)
        allowed = _allowed(q_pos[None, :, None], torch.arange(ctx_len, device=q.device), opts)
        o = _softmax_attention(
            q[s : s + n].transpose(0, 1)[None], ctx[0, ..., :k_dim], ctx[1, ..., :v_dim],
            allowed, opts,
        )  # fmt: skip
        out[s : s + n] = o[0].transpose(0, 1)
    return out


@dataclass(frozen=True, slots=True)
class _Options:
    scale: float
    window: int | None
    chunk: int | None
    softcap: float | None
    sinks: torch.Tensor | None  # [num_heads]


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, opts: _Options) -> torch.Tensor:
    """Bool mask (True: attend) broadcast from query positions ``q_pos`` (trailing axis 1)
    and key positions ``k_pos`` ``[L]``: causal, inside the window (HF keeps keys with
    ``q - k < window``) and in the query's chunk."""
    allowed = k_pos <= q_pos
    if opts.window is not None:
        allowed &= k_pos > q_pos - opts.window
    if opts.chunk is not None:
        allowed &= torch.div(k_pos, opts.chunk, rounding_mode="floor") == torch.div(
            q_pos, opts.chunk, rounding_mode="floor"
        )
    return allowed


def _softmax_attention(
    q: torch.Tensor,  # [B, heads, Lq, k_dim]
    k: torch.Tensor,  # [B, kv_heads, L, k_dim]
    v: torch.Tensor,  # [B, kv_heads, L, v_dim]
    allowed: torch.Tensor,  # [B, Lq, L] bool (or broadcastable)
    opts: _Options,
) -> torch.Tensor:
    """Attention with a float32 softmax → ``[B, heads, Lq, v_dim]``.  Without soft-cap or
    sinks it is SDPA; otherwise the explicit form of transformers' eager functions (scores
    → soft-cap → mask → sink column → softmax, sink column dropped)."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if opts.softcap is None and opts.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed[:, None], scale=opts.scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # fmt: skip
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * opts.scale
    if opts.softcap is not None:
        scores = torch.tanh(scores / opts.softcap) * opts.softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if opts.sinks is not None:
        sink = opts.sinks.float().view(1, num_heads, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)
