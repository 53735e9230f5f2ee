"""Output assembly: sampled rows → the step's :class:`~genserve.step.SampledToken` list, draft
acceptance, per-request bookkeeping, and prompt logprobs.

A speculative chunk has one sampling row per token.  Drafts are accepted while each equals
the token sampled at the position before it; the token sampled after the last accepted draft
is kept too.  A draft row samples with the output index it would have had in one-token steps,
so seeded sampling draws the same tokens with or without speculation.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genserve.step import (
    PromptLogprobs,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
    TokenLogprob,
)
from genserve.worker.device_io import DeviceIO
from genserve.worker.request_state import PenaltyCounts, RequestState
from genserve.worker.sampler import SamplerOutput, SamplingRow

# Prompt-logprob rows per LM-head call: bounds the float32 logits to ~100 MB (vocab 49152).
PROMPT_LOGPROB_ROWS = 512


def sampling_rows(
    chunks: list[ScheduledChunk], states: list[RequestState], penalties: PenaltyCounts
) -> list[SamplingRow]:
    """One :class:`SamplingRow` per sampled position (``num_draft_tokens + 1`` a chunk)."""
    rows = []
    for c, s in zip(chunks, states, strict=True):
        counts = output = None
        if c.req_id in penalties:
            if c.num_draft_tokens:
                raise ValueError(f"{c.req_id}: draft tokens for a request with penalties")
            counts, output = penalties.rows(c.req_id)
        rows += [
            SamplingRow(
                s.sampling,
                s.num_output_tokens + j,
                s.num_tokens + j,
                counts,
                output if _uses_output_counts(s.sampling) else None,
                s.last_token
                if c.token_from_last_step
                else c.token_ids[len(c.token_ids) - c.num_draft_tokens - 1 + j],
            )
            for j in range(c.num_draft_tokens + 1)
        ]
    return rows


@dataclass(frozen=True, slots=True)
class Accepted:
    sampled: tuple[SampledToken, ...]
    penalised_req_ids: list[str]  # requests with penalty counts, in row order
    penalised_rows: list[int]  # their sampling rows (one each: no drafts with penalties)
    # The row of each chunk's last kept token: where a placeholder of the next step reads.
    last_rows: dict[str, int]


def accept(
    out: SamplerOutput,
    chunks: list[ScheduledChunk],
    states: list[RequestState],
    penalties: PenaltyCounts,
    counted: bool = False,
) -> Accepted:
    """The tokens each chunk keeps, with ``states`` advanced past them (``counted``: their
    counts were advanced already, when the step was launched: only the last token is set)."""
    result: list[SampledToken] = []
    pen_ids: list[str] = []
    pen_rows: list[int] = []
    last_rows: dict[str, int] = {}
    row = 0
    for c, state in zip(chunks, states, strict=True):
        drafts = c.token_ids[len(c.token_ids) - c.num_draft_tokens :]
        num_accepted = 0
        while num_accepted < len(drafts) and (
            out.token_ids[row + num_accepted] == drafts[num_accepted]
        ):
            num_accepted += 1
        for j in range(row, row + num_accepted + 1):
            result.append(
                SampledToken(c.req_id, out.token_ids[j], out.logprobs[j], out.top_tokens[j])
            )
        if c.req_id in penalties:
            pen_ids.append(c.req_id)
            pen_rows.append(row)
        if not counted:
            state.num_output_tokens += num_accepted + 1
            state.num_tokens += num_accepted + 1
        last_rows[c.req_id] = row + num_accepted
        state.last_token = out.token_ids[row + num_accepted]
        row += c.num_draft_tokens + 1
    return Accepted(tuple(result), pen_ids, pen_rows, last_rows)


def grammar_rows(
    chunks: list[ScheduledChunk], step: SchedulerOutput | None
) -> tuple[torch.Tensor | None, list[int]]:
    """The step's grammar bitmask and the logits row of each of its rows (constrained
    chunks never carry drafts, so each has one row)."""
    if step is None or step.grammar_bitmask is None:
        return None, []
    first_row: dict[str, int] = {}
    row = 0
    for c in chunks:
        first_row[c.req_id] = row
        row += c.num_draft_tokens + 1
    bitmask = step.grammar_bitmask
    if not isinstance(bitmask, torch.Tensor):  # a PendingBitmask, filled during forward
        bitmask = bitmask.result()  # type: ignore[attr-defined]
    assert isinstance(bitmask, torch.Tensor)
    return bitmask, [first_row[r] for r in step.grammar_req_ids]


# (req_id, first_pos, first_row, count, target_ids)
PromptPart = tuple[str, int, int, int, tuple[int, ...]]


def prompt_logprob_parts(
    chunks: list[ScheduledChunk], offsets: np.ndarray, requests: dict[str, RequestState]
) -> list[PromptPart]:
    """For chunks of requests wanting prompt logprobs: ``(req_id, first_pos, first_row,
    count, target_ids)``; the row at position ``p`` predicts prompt token ``p + 1``."""
    parts = []
    for i, c in enumerate(chunks):
        state = requests.get(c.req_id)
        if state is None or not state.sampling.prompt_logprobs:
            continue
        last = min(c.start_pos + len(c.token_ids), state.num_prompt_tokens - 1)
        count = last - c.start_pos
        if count <= 0:
            continue
        targets = state.prompt_token_ids[c.start_pos + 1 : last + 1]
        parts.append((c.req_id, c.start_pos + 1, int(offsets[i]), count, targets))
    return parts


def _uses_output_counts(p: SamplingParams) -> bool:
    """Penalties over the output only: presence, and OpenAI's frequency penalty (#27)."""
    return p.presence_penalty != 0.0 or p.output_frequency_penalty != 0.0


def prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    parts: list[PromptPart],
    io: DeviceIO,
    is_driver: bool,
    num_tops: Sequence[int] = (),
) -> tuple[PromptLogprobs, ...]:
    """Logprobs of prompt tokens, computed ``PROMPT_LOGPROB_ROWS`` rows at a time so that a
    long prompt chunk never materialises ``[chunk, vocab]`` float32 logits at once.  Every
    rank runs the logits (the LM head gathers across shards); only the driver reports.
    (Prefill steps only: their one extra readback is not on the decode path.)"""
    rows = list(itertools.chain.from_iterable(range(p[2], p[2] + p[3]) for p in parts))
    targets = list(itertools.chain.from_iterable(p[4] for p in parts))
    # Issue #27: each part's top alternatives at its prompt positions (OpenAI echo's
    # top_logprobs); ``num_tops[i]`` for ``parts[i]``, none when empty.
    tops_wanted = list(num_tops) or [0] * len(parts)
    max_top = max(tops_wanted, default=0)
    values: list[float] = []
    tops: list[list[TokenLogprob]] = []
    for start in range(0, len(rows), PROMPT_LOGPROB_ROWS):
        index = io.upload(rows[start : start + PROMPT_LOGPROB_ROWS], torch.int64)
        target = io.upload(targets[start : start + PROMPT_LOGPROB_ROWS], torch.int64)
        logits = compute_logits(hidden.index_select(0, index))  # [rows, vocab]
        logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
        values.extend(logprobs.gather(1, target[:, None])[:, 0].tolist())
        if max_top:
            top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [rows, max_top]
            tops.extend(
                [TokenLogprob(t, lp) for t, lp in zip(ids, lps, strict=True)]
                for ids, lps in zip(top_ids.tolist(), top_values.tolist(), strict=True)
            )
    if not is_driver:
        return ()
    result = []
    start = 0
    for (req_id, first_pos, _, count, target_ids), num_top in zip(parts, tops_wanted, strict=True):
        lps = values[start : start + count]
        top = tuple(tuple(t[:num_top]) for t in tops[start : start + count]) if num_top else ()
        start += count
        result.append(
            PromptLogprobs(
                req_id,
                first_pos,
                tuple(TokenLogprob(t, lp) for t, lp in zip(target_ids, lps, strict=True)),
                top,
            )
        )
    return tuple(result)
