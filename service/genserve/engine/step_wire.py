"""What crosses the pipe between the engine process and the gRPC process (--engine-process).

One message per engine step, not one per token: a :class:`~genserve.engine.engine_loop.
Delivery` (every row's output of the step, plus the step's observation for metrics and
traces) and the scheduler's stats after it.  Messages are pickled tuples: the common row
(one token, no top tokens, not the last) travels as a tuple of plain values, which pickle
writes and reads in C, instead of two slotted dataclasses whose pickling runs
``__getstate__`` / ``__setstate__`` in Python per object; rare rows (the last one of a
request, top tokens) travel as the objects themselves.  The observation drops what no
observer reads (block tables, the grammar bitmask, prompt tokens of admitted requests).

Pure functions: no pipe, no threads (``engine/engine_process.py`` sends,
``engine/process_engine.py`` receives)."""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from genserve.engine.engine_loop import Delivery, StepObservation
from genserve.engine.outputs import GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.scheduler import SchedulerStats
from genserve.step import AdapterRef, NewRequestData, ScheduledChunk, SchedulerOutput

# Message kinds, the first item of every message tuple.
# engine -> front
HELLO = "hello"  # (HELLO, EngineHello): loaded, serving
FAILED = "failed"  # (FAILED, exception): loading failed, the process exits
STEP = "step"  # (STEP, encoded delivery, stats, num_steps)
DEAD = "dead"  # (DEAD, reason): the engine loop stopped for good (a runner died)
STATS = "stats"  # (STATS, SchedulerStats): after an abort (no step may follow soon)
REPLY = "reply"  # (REPLY, query id, ok, value)
REJECT = "reject"  # (REJECT, req_id, message): an ADD the engine could not start
# front -> engine
ADD = "add"  # (ADD, GenerationRequest less its grammar, GrammarSpec | None, AdapterRef | None)
ABORT = "abort"  # (ABORT, req_id)
QUERY = "query"  # (QUERY, query id, name): "stats" | "check_invariants"
COMPILE = "compile"  # (COMPILE, GrammarSpec): the front compiles it now; compile it too
SHUTDOWN = "shutdown"  # (SHUTDOWN,): end every request, stop, exit

PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True, slots=True)
class EngineHello:
    """What the engine process tells the front once it serves."""

    payload: Any  # the launcher's summary of what it loaded (opaque here)
    max_tokens_per_request: int  # the KV capacity the front checks requests against
    overlap: bool
    schedule_ahead: bool
    pid: int
    stats: SchedulerStats  # before the first step (the metrics' scrape reads the latest)


def dumps(message: tuple[Any, ...]) -> bytes:
    return pickle.dumps(message, protocol=PROTOCOL)


def loads(data: bytes) -> tuple[Any, ...]:
    message = pickle.loads(data)
    assert isinstance(message, tuple)
    return message


def add_message(req: GenerationRequest, adapter: AdapterRef | None) -> tuple[Any, ...]:
    """The ADD message for ``req``.  Its compiled grammar does not cross (xgrammar's compiled
    grammar is a C++ object, tens of KB to MBs serialised, per request): its spec does, and
    the engine process compiles it with its own cache (the front compiled it first, which
    validated it: a bad one never reaches the pipe)."""
    spec = req.grammar.spec if req.grammar is not None else None
    if req.grammar is not None:
        req = dataclasses.replace(req, grammar=None)
    return (ADD, req, spec, adapter)


# --------------------------------------------------------------------------- a step's delivery
_Row = tuple[Any, ...]


def encode_delivery(delivery: Delivery) -> tuple[list[_Row], tuple[Any, ...] | None]:
    rows: list[_Row] = []
    append = rows.append
    for req_id, out in delivery.outputs:
        tok = out.token
        if tok is not None and out.final is None and not out.top_tokens:
            append((req_id, out.index, tok.token_id, tok.text, tok.logprob, tok.special))
        else:
            append((req_id, out))
    obs = delivery.observation
    return rows, None if obs is None else _encode_observation(obs)


def decode_delivery(encoded: tuple[list[_Row], tuple[Any, ...] | None]) -> Delivery:
    rows, obs = encoded
    outputs: list[tuple[str, TokenOutput]] = []
    append = outputs.append
    for row in rows:
        if len(row) == 6:
            req_id, index, token_id, text, logprob, special = row
            append((req_id, TokenOutput(index, TokenInfo(token_id, text, logprob, special))))
        else:
            append((row[0], row[1]))
    return Delivery(outputs, None if obs is None else _decode_observation(obs))


def _encode_observation(obs: StepObservation) -> tuple[Any, ...]:
    step = obs.step
    chunks = [
        (c.req_id, c.token_ids, c.start_pos, c.sample, c.num_draft_tokens, c.token_from_last_step)
        for c in step.chunks
    ]
    admitted = [
        (n.req_id, n.num_prompt_tokens, n.num_output_tokens, n.sampling) for n in step.new_requests
    ]
    return (
        step.step_id,
        chunks,
        admitted,
        step.finished_req_ids,
        obs.duration_s,
        obs.num_finished,
        dict(obs.num_spec_tokens),
        obs.ended_s,
    )


class ChunkView(NamedTuple):
    """A :class:`ScheduledChunk` as step observers read it (no block table): made from the
    wire's tuple in one C call, where a frozen dataclass's ``__init__`` cost ~2 us a row."""

    req_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool
    num_draft_tokens: int
    token_from_last_step: bool

    @property
    def is_decode(self) -> bool:
        return len(self.token_ids) == 1 or self.num_draft_tokens > 0


def _decode_observation(encoded: tuple[Any, ...]) -> StepObservation:
    step_id, chunks, admitted, finished, duration_s, num_finished, spec, ended_s = encoded
    make = ChunkView._make
    step = SchedulerOutput(
        step_id=step_id,
        # Observers read only ScheduledChunk's fields that ChunkView has (duck-typed).
        chunks=cast(tuple[ScheduledChunk, ...], tuple(map(make, chunks))),
        new_requests=tuple(
            NewRequestData(req_id, (), num_prompt, num_output, sampling)
            for req_id, num_prompt, num_output, sampling in admitted
        ),
        finished_req_ids=finished,
    )
    return StepObservation(step, duration_s, num_finished, spec, ended_s)


def step_message(delivery: Delivery, stats: SchedulerStats, num_steps: int) -> bytes:
    return dumps((STEP, encode_delivery(delivery), stats, num_steps))
