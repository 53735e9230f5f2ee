"""Whole prompts of a step attended in one call: one causal SDPA call over right-padded
copies of their q/k/v instead of one call (and one copy back) per prompt.

Why: a step that carries prompts runs eagerly on CUDA (graphs replay pure-decode steps
only), and there its cost is host time per call.  On the GPU machine (an H200 with a slow
host CPU), an 8B model's eager steps at 64 streams spent about half the step thread's time
in the per-prompt attention loop.  Under ``is_causal`` a real query row never reaches the
padding after its own prompt, so its result is the per-prompt one; the padded rows are
computed and dropped.  Prompts that continue from the cache (a prefix hit, a later chunk)
keep their own call: their keys come from the cache through the block table."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from genserve.model import sdpa_pinned
from genserve.model.sdpa_pinned import expand_kv

# Batch only while padding adds at most this share again of the prompts' own tokens.
MAX_PADDING = 1.0


@dataclass(frozen=True, slots=True)
class PromptBatch:
    """Where the batched prompts' rows are in the flat batch and in the padded one."""

    rows: torch.Tensor  # [n] int64: the prompts' rows of the flat batch
    batch: torch.Tensor  # [n] int64: each row's prompt, 0..count-1
    pos: torch.Tensor  # [n] int64: each row's position in its prompt
    count: int
    max_len: int
    token_starts: frozenset[int]  # the first flat row of each prompt it covers


def prompt_index(prompts: list[tuple[int, int]]) -> np.ndarray | None:
    """``[3, n]`` int64 (flat rows, prompt of each row, position in its prompt) of the batch
    of whole prompts ``(first flat row, tokens)`` (each from position 0), or None where
    there are fewer than two or padding them to one length would cost too much."""
    if len(prompts) < 2:
        return None
    lengths = [n for _, n in prompts]
    if len(prompts) * max(lengths) > (1 + MAX_PADDING) * sum(lengths):
        return None
    rows = np.concatenate([np.arange(s, s + n) for s, n in prompts])
    batch = np.repeat(np.arange(len(prompts)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    return np.stack([rows, batch, pos]).astype(np.int64)


def from_index(prompts: list[tuple[int, int]], index: torch.Tensor) -> PromptBatch:
    """The :class:`PromptBatch` of ``prompts`` whose :func:`prompt_index` is on the device
    as ``index``."""
    starts = frozenset(s for s, _ in prompts)
    count, max_len = len(prompts), max(n for _, n in prompts)
    return PromptBatch(index[0], index[1], index[2], count, max_len, starts)


def prompt_batch(prompts: list[tuple[int, int]], device: torch.device) -> PromptBatch | None:
    """:func:`prompt_index` as a :class:`PromptBatch` on ``device`` (one copy)."""
    index = prompt_index(prompts)
    if index is None:
        return None
    return from_index(prompts, torch.from_numpy(index).to(device))


def attend_prompts(
    b: PromptBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    pinned: bool = False,
) -> None:
    """``q`` ``[tokens, heads, hd]``, ``k``/``v`` ``[tokens, kv_heads, hd]`` (this step's
    new keys and values): the prompts of ``b`` attended causally, into their rows of ``out``
    ``[tokens, heads * hd]``.  ``pinned``: SDPA's backend fixed and K/V expanded to the
    query heads (``model/sdpa_pinned.py``)."""
    _, num_heads, head_dim = q.shape
    padded = []
    for x in (q, k, v):
        rows = x.index_select(0, b.rows)
        if pinned:  # expanded after the gather: only the prompts' rows are copied
            rows = expand_kv(rows, num_heads, -2)
        buf = x.new_zeros(b.count, b.max_len, rows.shape[1], head_dim)
        buf[b.batch, b.pos] = rows
        padded.append(buf.transpose(1, 2))  # [count, heads, max_len, hd]
    q_b, k_b, v_b = padded
    with sdpa_pinned.pinned(q.device, masked=False) if pinned else contextlib.nullcontext():
        o = F.scaled_dot_product_attention(
            q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=num_heads != k_b.shape[1]
        )
    result = o.transpose(1, 2)[b.batch, b.pos]  # [n, heads, hd]
    out.index_copy_(0, b.rows, result.reshape(-1, num_heads * head_dim))
