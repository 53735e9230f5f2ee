"""What one request runs in a step: a slice of its known tokens (prefill, a prefill chunk,
recomputation or a decode), or its last token followed by n-gram draft tokens.  Pure Python.

A chunk's KV slots are allocated before it is built; ``sample`` is set when the chunk
reaches the end of the known sequence (the runner samples the next token there).
"""

from __future__ import annotations

from genserve.engine.request import Request
from genserve.engine.speculative import DraftLengthController, NgramProposer
from genserve.kv_cache.manager import KVCacheManager
from genserve.step import ScheduledChunk


def token_slice(req: Request, start: int, end: int) -> tuple[int, ...]:
    """``req.all_token_ids[start:end]`` without concatenating the whole sequence."""
    num_prompt = req.num_prompt_tokens
    if start >= num_prompt:
        return tuple(req.output_token_ids[start - num_prompt : end - num_prompt])
    if end <= num_prompt:
        return tuple(req.prompt_token_ids[start:end])
    return tuple(req.prompt_token_ids[start:]) + tuple(req.output_token_ids[: end - num_prompt])


def plain_chunk(req: Request, num_new: int, kv: KVCacheManager) -> ScheduledChunk:
    """The next ``num_new`` tokens of ``req`` (its slots already allocated), after those
    already scheduled.  When the step in flight samples ``req``'s next token, the chunk is
    that one decode token, as a placeholder the runner fills (``token_from_last_step``)."""
    start = req.num_scheduled_tokens
    end = start + num_new
    if end > req.num_tokens:  # the token is being sampled by the step in flight
        if (start, end) != (req.num_tokens, req.num_tokens + 1):
            raise AssertionError(f"{req.req_id}: chunk {start}..{end} past a pending token")
        return ScheduledChunk(
            req_id=req.req_id,
            token_ids=(0,),
            start_pos=start,
            block_ids=kv.block_ids(req.req_id),
            sample=True,
            token_from_last_step=True,
        )
    return ScheduledChunk(
        req_id=req.req_id,
        token_ids=token_slice(req, start, end),
        start_pos=start,
        block_ids=kv.block_ids(req.req_id),
        sample=end == req.num_expected_tokens,
    )


def speculative_chunk(
    req: Request,
    kv: KVCacheManager,
    proposer: NgramProposer,
    draft_lengths: DraftLengthController,
    num_reserved_blocks: int,
) -> ScheduledChunk | None:
    """The decode chunk of ``req`` with draft tokens, its slots allocated; None when it
    gets no drafts (penalties, nothing matched, or fewer than ``num_reserved_blocks``
    blocks would stay free)."""
    if req.sampling.uses_penalties:
        return None  # penalties change with every accepted token: verify rows would differ
    if req.grammar is not None:
        return None  # structured output: the mask depends on each accepted token
    # The token sampled after the last accepted draft counts against max_new_tokens too.
    room = req.stopping.max_new_tokens - req.num_output_tokens - 1
    max_drafts = min(draft_lengths.allowed(req.req_id), room)
    if max_drafts <= 0:
        return None
    drafts = proposer.propose(req.req_id, req.prompt_token_ids, req.output_token_ids, max_drafts)
    if not drafts:
        return None
    if kv.allocate_slots(req, 1 + len(drafts), (), num_reserved_blocks) is None:
        return None
    start = req.num_computed_tokens
    return ScheduledChunk(
        req_id=req.req_id,
        token_ids=token_slice(req, start, start + 1) + drafts,
        start_pos=start,
        block_ids=kv.block_ids(req.req_id),
        sample=True,
        num_draft_tokens=len(drafts),
    )
