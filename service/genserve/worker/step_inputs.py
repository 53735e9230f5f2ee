"""Input preparation: a :class:`~genserve.step.SchedulerOutput` → the flat batch layout the
model runs (no padding, no device work beyond the uploads it is asked for).

Order of the flat batch: one-token decode chunks first, then speculative chunks (the last
token and its drafts, every token a decode row of its own: its context ends at its position),
then prefill chunks, each with its own positions and block table.  Decodes first because the
attention backends batch them into one op.

``layout(..., prompt_rows=True)`` lays prompt chunks out as speculative chunks are: every
prompt token a decode row whose context ends at its position.  Attention over a row's cached
context up to its own position is causal attention, and a step stores every row's K/V
before any row attends, so the step computes what a prefill computes — through the decode
path, which a CUDA graph replays (``ModelRunner.launch``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from genserve.model.attention import SeqSpec
from genserve.step import ScheduledChunk, SchedulerOutput
from genserve.worker.device_io import DeviceIO


@dataclass(frozen=True, slots=True)
class StepLayout:
    """The chunks of one step in flat-batch order and their attention sequences."""

    chunks: list[ScheduledChunk]
    num_single: int  # one-token decode chunks, first
    num_decode_chunks: int  # those plus the speculative chunks
    seqs: list[SeqSpec]  # one per decode row, then one per prefill chunk
    num_decodes: int  # decode rows (a speculative chunk gives one per token)

    @property
    def pure_decode(self) -> bool:
        """Every row is a decode row (what a CUDA graph can replay)."""
        return self.num_decode_chunks == len(self.chunks)

    @property
    def offsets(self) -> np.ndarray:
        """``[num_chunks + 1]`` first row of each chunk (and the total)."""
        return np.cumsum([0] + [len(c.token_ids) for c in self.chunks])

    def sample_rows(self) -> tuple[list[int], bool]:
        """Rows whose logits are sampled (a chunk that samples: its last token; a
        speculative chunk: every token), and whether they are exactly ``0..n-1`` (then the
        hidden states need no gather)."""
        if self.num_single == len(self.chunks):  # one token a chunk (decode steps): row i
            rows = [i for i, c in enumerate(self.chunks) if c.sample]
            return rows, len(rows) == 0 or rows[-1] == len(rows) - 1
        offsets = self.offsets
        rows = [
            row
            for i, c in enumerate(self.chunks)
            if c.sample
            for row in range(int(offsets[i + 1]) - 1 - c.num_draft_tokens, int(offsets[i + 1]))
        ]
        return rows, rows == list(range(len(rows)))


def layout(
    step: SchedulerOutput,
    known_len: Callable[[str], int] | None = None,
    prompt_rows: bool = False,
) -> StepLayout:
    """The flat-batch order of ``step``'s chunks (see the module docstring).  ``known_len``:
    a request's prompt length, asked for prompt chunks only, whose rows then carry the whole
    prompt's length (``SeqSpec.known_len``).  ``prompt_rows``: prompt chunks as decode rows,
    one a token (for models whose rotation depends on the position only)."""
    chunks = [c for c in step.chunks if len(c.token_ids) == 1]
    num_single = len(chunks)
    chunks += [c for c in step.chunks if c.num_draft_tokens]
    if prompt_rows:
        chunks += [c for c in step.chunks if not c.is_decode]
    num_decode_chunks = len(chunks)
    if not prompt_rows:
        chunks += [c for c in step.chunks if not c.is_decode]
    seqs = [SeqSpec(1, c.start_pos, c.block_ids) for c in chunks[:num_single]]
    for c in chunks[num_single:num_decode_chunks]:
        seqs += [SeqSpec(1, c.start_pos + j, c.block_ids) for j in range(len(c.token_ids))]
    num_decodes = len(seqs)
    seqs += [
        SeqSpec(len(c.token_ids), c.start_pos, c.block_ids, known_len(c.req_id) if known_len else 0)
        for c in chunks[num_decode_chunks:]
    ]
    return StepLayout(chunks, num_single, num_decode_chunks, seqs, num_decodes)


def flat_inputs(plan: StepLayout, io: DeviceIO) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_ids, positions)``, ``[num_tokens]`` int64 each, uploaded asynchronously."""
    token_ids = itertools.chain.from_iterable(c.token_ids for c in plan.chunks)
    ids = io.upload(list(token_ids), torch.int64)
    positions = io.upload_tensor(torch.from_numpy(_positions(plan.chunks, plan.num_single)))
    return ids, positions


def _positions(chunks: list[ScheduledChunk], num_single: int) -> np.ndarray:
    """``[num_tokens]`` int64 positions of the flat batch (``chunks[:num_single]`` have one
    token each)."""
    parts = [np.fromiter((c.start_pos for c in chunks[:num_single]), np.int64, num_single)]
    parts += [
        np.arange(c.start_pos, c.start_pos + len(c.token_ids), dtype=np.int64)
        for c in chunks[num_single:]
    ]
    return np.concatenate(parts)
