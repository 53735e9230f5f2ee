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

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

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


def prompt_batch(prompts: list[tuple[int, int]], device: torch.device) -> PromptBatch | None:
    """The batch of whole prompts ``(first flat row, tokens)`` (each from position 0), or
    None where there are fewer than two or padding them to one length would cost too much.
    The index tensors go to ``device`` in one copy, once per step."""
    if len(prompts) < 2:
        return None
    lengths = [n for _, n in prompts]
    max_len = max(lengths)
    if len(prompts) * max_len > (1 + MAX_PADDING) * sum(lengths):
        return None
    rows = np.concatenate([np.arange(s, s + n) for s, n in prompts])
    batch = np.repeat(np.arange(len(prompts)), lengths)
    pos = np.concatenate([np.arange(n) for n in lengths])
    index = torch.from_numpy(np.stack([rows, batch, pos]).astype(np.int64)).to(device)
    starts = frozenset(s for s, _ in prompts)
    return PromptBatch(index[0], index[1], index[2], len(prompts), max_len, starts)


def attend_prompts(
    b: PromptBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """``q`` ``[tokens, heads, hd]``, ``k``/``v`` ``[tokens, kv_heads, hd]`` (this step's
    new keys and values): the prompts of ``b`` attended causally, into their rows of ``out``
    ``[tokens, heads * hd]``."""
    _, num_heads, head_dim = q.shape
    padded = []
    for x in (q, k, v):
        buf = x.new_zeros(b.count, b.max_len, x.shape[1], head_dim)
        buf[b.batch, b.pos] = x.index_select(0, b.rows)
        padded.append(buf.transpose(1, 2))  # [count, heads, max_len, hd]
    q_b, k_b, v_b = padded
    o = F.scaled_dot_product_attention(
        q_b, k_b, v_b, is_causal=True, scale=scale, enable_gqa=num_heads != k.shape[1]
    )
    rows = o.transpose(1, 2)[b.batch, b.pos]  # [n, heads, hd]
    out.index_copy_(0, b.rows, rows.reshape(-1, num_heads * head_dim))
