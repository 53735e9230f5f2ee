"""The typed messages rank 0 sends to tensor-parallel shard workers, and their wire encoding.

Every message is a frozen dataclass; on the wire it is a kind (a small integer from
:class:`MessageKind`) and a payload: the message's fields as a JSON array, in declaration
order, nested dataclasses as nested arrays.  Nothing executable travels: no pickles, no method
names; the decoder rebuilds exactly the dataclasses of :mod:`genserve.step` and checks every
field's type, so a mismatched peer fails loudly with :class:`ProtocolError` instead of
computing garbage.

Pure Python (no torch), so the encoding is unit-tested on its own.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, TypeAlias

from genserve.step import (
    AdapterRef,
    NewRequestData,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)


class ProtocolError(ValueError):
    """A message could not be decoded (a peer speaking another version, or corruption)."""


class MessageKind(enum.IntEnum):
    STEP = 1
    INIT_KV_CACHE = 2
    SHUTDOWN = 3


@dataclass(frozen=True, slots=True)
class StepMessage:
    """Run this engine step (workers compute their shard and skip sampling)."""

    step: SchedulerOutput


@dataclass(frozen=True, slots=True)
class InitKVCacheMessage:
    """Allocate a fresh (zeroed) KV cache, dropping any previous one: every rank holds the
    same number of blocks, each of its own KV heads."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class ShutdownMessage:
    """Leave the message loop and exit cleanly."""


ShardMessage: TypeAlias = StepMessage | InitKVCacheMessage | ShutdownMessage


# ------------------------------------------------------------------------------- encoding
def encode(message: ShardMessage) -> tuple[MessageKind, bytes]:
    """``(kind, payload)`` for ``message``."""
    body: list[Any]
    if isinstance(message, StepMessage):
        kind, body = MessageKind.STEP, _step_fields(message.step)
    elif isinstance(message, InitKVCacheMessage):
        kind, body = MessageKind.INIT_KV_CACHE, [message.num_blocks, message.block_size]
    else:
        kind, body = MessageKind.SHUTDOWN, []
    return kind, json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _step_fields(step: SchedulerOutput) -> list[Any]:
    return [
        step.step_id,
        [
            [c.req_id, c.token_ids, c.start_pos, c.block_ids, c.sample, c.num_draft_tokens]
            for c in step.chunks
        ],
        [
            [
                n.req_id,
                n.all_token_ids,
                n.num_prompt_tokens,
                n.num_output_tokens,
                _sampling(n),
                *_adapter(n),
            ]
            for n in step.new_requests
        ],
        step.finished_req_ids,
    ]


def _adapter(new: NewRequestData) -> list[Any]:
    """LoRA: an optional trailing field ``[slot, adapter_id, path]`` (absent: base model)."""
    a = new.adapter
    return [] if a is None else [[a.slot, a.adapter_id, a.path]]


def _sampling(new: NewRequestData) -> list[Any]:
    p = new.sampling
    return [
        p.temperature,
        p.top_k,
        p.top_p,
        p.typical_p,
        p.repetition_penalty,
        p.frequency_penalty,
        p.seed,
        p.num_top_tokens,
        p.prompt_logprobs,
        p.presence_penalty,
    ]


# ------------------------------------------------------------------------------- decoding
def decode(kind: int, payload: bytes) -> ShardMessage:
    """The message ``encode`` turned into ``(kind, payload)``; :class:`ProtocolError` when the
    bytes are not such a message."""
    try:
        message_kind = MessageKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None
    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"{message_kind.name}: payload is not JSON: {exc}") from None
    fields = _list(body, message_kind.name)
    if message_kind is MessageKind.STEP:
        return StepMessage(_step(fields))
    if message_kind is MessageKind.INIT_KV_CACHE:
        num_blocks, block_size = _exactly(fields, 2, "INIT_KV_CACHE")
        return InitKVCacheMessage(_int(num_blocks), _int(block_size))
    _exactly(fields, 0, message_kind.name)
    return ShutdownMessage()


def _step(fields: list[Any]) -> SchedulerOutput:
    step_id, chunks, new_requests, finished = _exactly(fields, 4, "step")
    return SchedulerOutput(
        step_id=_int(step_id),
        chunks=tuple(_chunk(c) for c in _list(chunks, "chunks")),
        new_requests=tuple(_new_request(n) for n in _list(new_requests, "new_requests")),
        finished_req_ids=tuple(_str(r) for r in _list(finished, "finished_req_ids")),
    )


def _chunk(value: Any) -> ScheduledChunk:
    fields = _exactly(_list(value, "chunk"), 6, "chunk")
    req_id, token_ids, start_pos, block_ids, sample, num_draft_tokens = fields
    return ScheduledChunk(
        req_id=_str(req_id),
        token_ids=_ints(token_ids),
        start_pos=_int(start_pos),
        block_ids=_ints(block_ids),
        sample=_bool(sample),
        num_draft_tokens=_int(num_draft_tokens),
    )


def _new_request(value: Any) -> NewRequestData:
    fields = _list(value, "new_request")
    adapter = _adapter_ref(fields.pop()) if len(fields) == 6 else None
    req_id, token_ids, num_prompt, num_output, sampling = _exactly(fields, 5, "new_request")
    (temperature, top_k, top_p, typical_p, rep, freq, seed, num_top, prompt_lp, presence) = (
        _exactly(_list(sampling, "sampling"), 10, "sampling")
    )
    return NewRequestData(
        req_id=_str(req_id),
        all_token_ids=_ints(token_ids),
        num_prompt_tokens=_int(num_prompt),
        num_output_tokens=_int(num_output),
        sampling=SamplingParams(
            temperature=_float(temperature),
            top_k=_int(top_k),
            top_p=_float(top_p),
            typical_p=_float(typical_p),
            repetition_penalty=_float(rep),
            frequency_penalty=_float(freq),
            seed=_int(seed),
            num_top_tokens=_int(num_top),
            prompt_logprobs=_bool(prompt_lp),
            presence_penalty=_float(presence),
        ),
        adapter=adapter,
    )


def _adapter_ref(value: Any) -> AdapterRef:
    slot, adapter_id, path = _exactly(_list(value, "adapter"), 3, "adapter")
    return AdapterRef(_int(slot), _str(adapter_id), _str(path))


def _exactly(values: list[Any], n: int, what: str) -> list[Any]:
    if len(values) != n:
        raise ProtocolError(f"{what}: expected {n} fields, got {len(values)}")
    return values


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{what}: expected an array, got {type(value).__name__}")
    return value


def _int(value: Any) -> int:
    if type(value) is not int:  # bool is an int subclass: refuse it here
        raise ProtocolError(f"expected an integer, got {value!r}")
    return value


def _ints(value: Any) -> tuple[int, ...]:
    values = _list(value, "token/block ids")
    if not all(type(v) is int for v in values):  # one pass; prompts can be long
        raise ProtocolError(f"expected integers, got {values!r:.80}")
    return tuple(values)


def _float(value: Any) -> float:
    if type(value) not in (int, float):
        raise ProtocolError(f"expected a number, got {value!r}")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"expected a string, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"expected true or false, got {value!r}")
    return value
