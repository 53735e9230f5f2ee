"""``best_of`` (TGI) and ``n`` (OpenAI / vLLM): several sequences for one prompt.

Validation follows TGI's router: ``best_of`` must be in ``[1, --max-best-of]``, ``best_of > 1``
requires sampling (several greedy sequences would be identical), and streams refuse it.
``n`` (vLLM's rule: ``n <= best_of`` when both are given) asks for ``n`` results; ``n > 1``
without sampling is allowed and returns identical sequences, as OpenAI and vLLM do.  Unlike
TGI, a ``seed`` is accepted with ``best_of``: sequence ``i`` samples with ``seed + i``, so
the sequences differ and the whole answer is reproducible.

The sequences are generated as one leader request and followers that share its prompt KV
(engine/prompt_fork.py: the prompt is prefilled once).  Ranking the finished sequences is
output assembly (server/generate_render.py), not conversion.
"""

from __future__ import annotations

import dataclasses

from genserve.engine.outputs import GenerationRequest
from genserve.server.conversion.errors import ValidationError
from genserve.server.conversion.limits import Limits
from genserve.v1 import generate_pb2 as pb


def num_sequences(params: pb.GenerateParameters, limits: Limits, sampling: bool) -> int:
    """How many sequences to generate per input; raises ValidationError."""
    best_of = params.best_of if params.HasField("best_of") else 1
    n = params.n if params.HasField("n") else 1
    if best_of < 1:
        raise ValidationError("`best_of` must be strictly positive")
    if n < 1:
        raise ValidationError("`n` must be strictly positive")
    if best_of > limits.max_best_of:
        raise ValidationError(
            f"`best_of` is {best_of}; at most {limits.max_best_of} is allowed (--max-best-of)"
        )
    if n > limits.max_best_of:
        raise ValidationError(
            f"`n` is {n}; at most {limits.max_best_of} is allowed (--max-best-of)"
        )
    if best_of > 1 and not sampling:
        raise ValidationError("you must use sampling when `best_of` is > 1")
    if params.HasField("best_of") and best_of < n:
        raise ValidationError(f"`best_of` ({best_of}) must be >= `n` ({n})")
    return max(best_of, n)


def check_stream(params: pb.GenerateParameters) -> None:
    """Streams carry one sequence: TGI refuses ``best_of > 1`` there, and so ``n > 1``."""
    if params.HasField("best_of") and params.best_of > 1:
        raise ValidationError("`best_of` != 1 is not allowed for this endpoint (streaming)")
    if params.HasField("n") and params.n > 1:
        raise ValidationError("`n` > 1 is not allowed for streaming")


def fork(req: GenerationRequest, count: int) -> list[GenerationRequest]:
    """``req`` (the leader) followed by ``count - 1`` followers sharing its prompt KV."""
    out = [req]
    for i in range(1, count):
        seed = req.sampling.seed + i if req.seed is not None else None
        sampling = dataclasses.replace(
            req.sampling,
            seed=(req.sampling.seed + i) & ((1 << 63) - 1) if seed is not None else 0,
            prompt_logprobs=False,  # the prefill details are the leader's
        )
        out.append(
            dataclasses.replace(
                req,
                req_id=f"{req.req_id}/seq{i}",
                sampling=sampling,
                seed=sampling.seed if seed is not None else None,
                fork_of=req.req_id,
            )
        )
    return out
