"""What the scheduler reports: per-request step results and counters.  Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from genserve.engine.request import FinishReason
from genserve.step import PromptLogprobs, SampledToken


# Not frozen: one is made per request every step on the engine thread, and a frozen
# dataclass's __init__ (object.__setattr__ per field) costs about four times as much.  Treat
# it as immutable all the same.
@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request: a token, prompt logprobs, and/or its end.

    ``finish_reason`` is set exactly once per request, on its last output, for finishes the
    scheduler decides (EOS, length).  Finishes requested through ``finish_requests`` produce
    no output (the caller already knows).
    """

    req_id: str
    new_token: SampledToken | None
    prompt_logprobs: PromptLogprobs | None
    finish_reason: FinishReason | None
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first admission
    num_output_tokens: int  # tokens generated so far, ``new_token`` included
    num_preemptions: int


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    kv_usage: float  # used / total blocks
    num_preemptions: int  # since start
    prefix_cache_queries: int  # tokens looked up since start
    prefix_cache_hits: int  # tokens found since start
    last_step_num_reqs: int
    last_step_num_tokens: int
    last_step_num_prefill_tokens: int
    growth_reserve_ratio: float  # admission headroom in use (learned unless configured)
    spec_draft_tokens: int = 0  # speculative draft tokens verified since start
    spec_accepted_tokens: int = 0  # of which accepted
