"""A generation request as the engine tracks it (rank 0 only; never sent to the runner)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from genserve.step import AdapterRef, SamplingParams

if TYPE_CHECKING:
    from genserve.engine.grammar import GrammarState


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    # Ended by the server or the client rather than by decoding:
    ABORTED = "aborted"  # cancelled by the client, deadline exceeded, or shutdown
    ERROR = "error"  # the runner failed while this request was in the batch


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"  # blocks were taken back; waits to be recomputed
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class StoppingCriteria:
    """Token-level limits checked by the scheduler; stop *strings* are checked by the
    engine's output processor, which sees text."""

    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Issue #15: ids that end generation like EOS (finish reason STOP_SEQUENCE), ignore_eos or not.
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(eq=False, slots=True)
class Request:
    """Mutable state of one request.  Identity equality: one object per request."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stopping: StoppingCriteria
    arrival_time: float = field(default_factory=time.monotonic)
    # Extra keys that make otherwise equal token blocks different cache entries (adapter id, ...).
    cache_salt: str | None = None
    # Structured output: the matcher, advanced with every kept output token (survives
    # preemption with the output tokens themselves, so nothing is replayed).
    grammar: GrammarState | None = None
    adapter: AdapterRef | None = None  # LoRA adapter and its runner slot; None: base model
    # best_of / n: the request whose computed prompt blocks this one shares (prompt_fork.py)
    fork_of: str | None = None

    output_token_ids: list[int] = field(default_factory=list)
    # Positions whose KV is in this request's blocks (computed or taken from the prefix cache).
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache at the first admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Overlapped scheduling (issue #29): positions scheduled in steps whose results have not
    # been applied yet (their KV is being computed), and tokens those steps will sample.
    # Both are 0 whenever no step is in flight.
    num_in_flight_tokens: int = 0
    num_pending_outputs: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        """Positions computed or being computed (where the next chunk starts)."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_expected_tokens(self) -> int:
        """Known tokens plus those the steps in flight will sample."""
        return self.num_tokens + self.num_pending_outputs

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def stop_reason(req: Request, token_id: int) -> FinishReason | None:
    """Why ``req`` ends with ``token_id`` just appended, or None: length first (as TGI),
    then EOS (unless ignored), then a user-given stop token id."""
    stopping = req.stopping
    if req.num_output_tokens >= stopping.max_new_tokens:
        return FinishReason.LENGTH
    if not stopping.ignore_eos and token_id in stopping.eos_token_ids:
        return FinishReason.EOS_TOKEN
    if token_id in stopping.stop_token_ids:  # vLLM's stop_token_ids: a user-given stop
        return FinishReason.STOP_SEQUENCE
    return None
