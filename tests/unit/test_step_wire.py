"""--engine-process's per-step message (engine/step_wire.py): what the front decodes is what
the engine loop delivered, for every kind of row, and what observers read of the step."""

from __future__ import annotations

import pickle

from genserve.bench.step_wire_cost import make_step
from genserve.engine import step_wire as wire
from genserve.engine.engine_loop import Delivery, StepObservation
from genserve.engine.outputs import FinalInfo, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason
from genserve.step import NewRequestData, SamplingParams, ScheduledChunk, SchedulerOutput


def test_rows_of_every_kind_round_trip() -> None:
    prefill = (TokenInfo(1, "x", -1.0, False),)
    final = FinalInfo(FinishReason.LENGTH, "ab", 2, 3, 0, 0, prefill=prefill)
    outputs = [
        ("a", TokenOutput(0, TokenInfo(5, " a", -0.5, False))),  # the common row
        ("b", TokenOutput(1, TokenInfo(6, "", None, True), (TokenInfo(7, "t", -2.0, False),))),
        ("c", TokenOutput(2, TokenInfo(8, "b", -0.1, False), final=final)),
        ("d", TokenOutput(0, None, final=final)),  # ended without a token
    ]
    message = wire.loads(wire.step_message(Delivery(outputs, None), make_step(1)[1], 3))
    assert message[0] == wire.STEP and message[3] == 3
    decoded = wire.decode_delivery(message[1])
    assert decoded.outputs == outputs
    assert decoded.observation is None


def test_observers_read_the_same_step() -> None:
    sampling = SamplingParams()
    step = SchedulerOutput(
        step_id=9,
        chunks=(
            ScheduledChunk("a", (1, 2, 3), 0, (4, 5), False),
            ScheduledChunk("b", (7,), 30, (6,), True),
            ScheduledChunk("c", (8, 9), 12, (1,), True, num_draft_tokens=1),
        ),
        new_requests=(NewRequestData("a", (1, 2, 3, 4), 4, 0, sampling),),
        finished_req_ids=("z",),
    )
    obs = StepObservation(step, 0.02, 1, {"c": 2}, 55.5)
    got = wire.decode_delivery(wire.encode_delivery(Delivery([], obs))).observation
    assert got is not None
    assert (got.duration_s, got.num_finished, dict(got.num_spec_tokens), got.ended_s) == (
        0.02, 1, {"c": 2}, 55.5,
    )  # fmt: skip
    assert got.step.step_id == 9 and got.step.num_tokens == step.num_tokens
    assert got.step.finished_req_ids == ("z",)
    assert [n.req_id for n in got.step.new_requests] == ["a"]
    fields = ("req_id", "token_ids", "start_pos", "sample", "num_draft_tokens", "is_decode")
    for mine, theirs in zip(got.step.chunks, step.chunks, strict=True):
        assert [getattr(mine, f) for f in fields] == [getattr(theirs, f) for f in fields]


def test_the_compact_message_is_smaller_than_pickled_objects() -> None:
    delivery, stats = make_step(256)
    compact = wire.step_message(delivery, stats, 1)
    naive = pickle.dumps((wire.STEP, delivery, stats, 1), protocol=wire.PROTOCOL)
    assert len(compact) * 3 < len(naive)
