"""Parallel sampling (``best_of`` / ``n``) with the prompt prefilled once.

A request asking for ``k`` sequences becomes ``k`` engine requests: a *leader* and ``k - 1``
*followers* that name it in ``Request.fork_of``.  A follower is not admitted until its
leader has computed the prompt; it then starts with the leader's full prompt blocks in its
own block table (one more owner each, refcounted by the block pool) and computes only the
tail after the last full block (at most ``block_size`` tokens, the last one being needed for
its own first-token logits).  So the prompt's KV is computed once and stored once.

Why this design and not vLLM v0's ``fork`` with a copy-on-write block copy: genserve's
block tables already share full, read-only blocks between requests (the prefix cache), and a
request never writes below its ``num_computed_tokens``, so full prompt blocks can be shared
safely with no new runner operation.  The partially filled last block is the only block the
sequences would write differently; instead of copying it (a new KV-copy instruction in the
step protocol, for the single runner and every tensor-parallel shard), each follower
recomputes those < ``block_size`` tokens into a block of its own: that *is* the copy at the
first diverging block, done by the forward pass.  This is also what vLLM v1 does for
``n > 1`` (child requests sharing the parent's prompt through the prefix cache), made
explicit here so it works with ``--disable-prefix-caching`` too and cannot race: the
follower waits for its leader instead of prefilling the same prompt concurrently.

Each sequence stays a normal request for preemption, cancellation and finishing: freeing a
follower drops only its own ownership of the shared blocks, the leader's likewise, and a
block returns to the pool when its last owner lets go.  A preempted follower (or one whose
leader is gone) is readmitted like any request (prefix-cache lookup, else recomputation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from genserve.kv_cache.block_pool import KVBlock
    from genserve.kv_cache.manager import KVCacheManager


class Wait:
    """The follower's leader has not computed the prompt yet."""


WAIT = Wait()


def computed_prefix(
    req: Request, requests: dict[str, Request], kv: KVCacheManager
) -> tuple[list[KVBlock], int] | Wait:
    """What ``req`` starts from when admitted: ``(blocks, num_computed_tokens)`` as
    :meth:`KVCacheManager.get_computed_blocks` returns them, or :data:`WAIT`."""
    leader = requests.get(req.fork_of) if req.fork_of is not None else None
    if leader is None or req.status is not RequestStatus.WAITING:
        return kv.get_computed_blocks(req)
    # Full blocks of the prompt, leaving its last token to compute (its logits are needed).
    num_shared = (req.num_prompt_tokens - 1) // kv.block_size
    if num_shared == 0:  # shorter than a block: nothing to share, nothing to wait for
        return kv.get_computed_blocks(req)
    if leader.status is not RequestStatus.RUNNING:
        return WAIT
    if leader.num_computed_tokens < num_shared * kv.block_size:
        return WAIT  # its prompt is still being prefilled (chunked prefill)
    return kv.owned_blocks(leader.req_id)[:num_shared], num_shared * kv.block_size
