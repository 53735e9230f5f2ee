"""The rank 0 → shard-worker messages survive encoding exactly, and malformed bytes are
refused with ProtocolError rather than turned into a wrong step."""

from __future__ import annotations

import json

import pytest

from genserve.step import NewRequestData, SamplingParams, ScheduledChunk, SchedulerOutput
from genserve.worker.shard_messages import (
    InitKVCacheMessage,
    MessageKind,
    ProtocolError,
    ShardMessage,
    ShutdownMessage,
    StepMessage,
    decode,
    encode,
)

STEP = SchedulerOutput(
    step_id=17,
    chunks=(
        ScheduledChunk("a", (5,), 40, (1, 2, 3), True),
        ScheduledChunk("b-é東", tuple(range(300)), 16, (9, 4), False),
        ScheduledChunk("c", (8, 9, 9, 9), 70, (4, 5, 6, 7, 8), True, num_draft_tokens=3),
    ),
    new_requests=(
        NewRequestData(
            "b-é東",
            tuple(range(316)),
            310,
            6,
            SamplingParams(
                temperature=0.7,
                top_k=5,
                top_p=0.9,
                typical_p=0.95,
                repetition_penalty=1.1,
                frequency_penalty=0.2,
                seed=2**63 - 1,
                num_top_tokens=3,
                prompt_logprobs=True,
                presence_penalty=-0.5,
            ),
        ),
        NewRequestData("c", (1,), 1, 0, SamplingParams()),
    ),
    finished_req_ids=("x", "y"),
)


@pytest.mark.parametrize(
    "message",
    [
        StepMessage(STEP),
        StepMessage(SchedulerOutput(step_id=-1, chunks=(), finished_req_ids=("warmup",))),
        InitKVCacheMessage(num_blocks=4096, block_size=16),
        ShutdownMessage(),
    ],
)
def test_round_trip(message: ShardMessage) -> None:
    kind, payload = encode(message)
    decoded = decode(int(kind), payload)
    assert decoded == message
    assert type(decoded) is type(message)


def test_step_fields_keep_their_types() -> None:
    decoded = decode(*encode(StepMessage(STEP)))
    assert isinstance(decoded, StepMessage)
    sampling = decoded.step.new_requests[1].sampling
    # JSON writes 0.0 as 0.0 and 1 as 1: floats must come back as floats, ints as ints.
    assert isinstance(sampling.temperature, float) and isinstance(sampling.top_k, int)
    assert decoded.step.chunks[0].sample is True


@pytest.mark.parametrize(
    ("kind", "payload", "needle"),
    [
        (99, b"[]", "unknown message kind"),
        (int(MessageKind.SHUTDOWN), b"not json", "not JSON"),
        (int(MessageKind.SHUTDOWN), b"[1]", "expected 0 fields"),
        (int(MessageKind.INIT_KV_CACHE), b"[1.5, 16]", "integer"),
        (int(MessageKind.INIT_KV_CACHE), b"[true, 16]", "integer"),
        (int(MessageKind.STEP), b"{}", "array"),
        (int(MessageKind.STEP), b'[1, [["a", [1, "2"], 0, [0], true, 0]], [], []]', "integers"),
        (int(MessageKind.STEP), b'[1, [["a", [1], 0, [0], 1, 0]], [], []]', "true or false"),
        (int(MessageKind.STEP), b'[1, [["a", [1], 0, [0], true]], [], []]', "expected 6 fields"),
        (int(MessageKind.STEP), b"[1, [], [], [3]]", "string"),
    ],
)
def test_malformed_messages_are_refused(kind: int, payload: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle):
        decode(kind, payload)


def test_payload_is_plain_json_of_field_values() -> None:
    """Nothing but data travels: the payload parses as JSON arrays of numbers/strings."""
    kind, payload = encode(InitKVCacheMessage(8, 16))
    assert kind is MessageKind.INIT_KV_CACHE
    assert json.loads(payload) == [8, 16]
