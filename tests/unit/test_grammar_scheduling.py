"""The scheduler's side of structured output: the matcher of a constrained request sees each
kept output token exactly once and in order, also across a preemption (the recompute
replays KV, not the grammar: the matcher lives with the output tokens), every sampling step
of the request carries its bitmask row, and constrained rows get no draft tokens."""

from __future__ import annotations

from typing import cast

import torch

from genserve.engine.grammar import BitmaskFiller, GrammarState
from genserve.engine.request import RequestStatus
from genserve.engine.scheduler_config import SchedulerConfig
from tests.unit.scheduler_fakes import VOCAB_SIZE, Harness


class RecordingGrammar:
    """Allows every token; records what it was advanced with."""

    def __init__(self) -> None:
        self.vocab_size = VOCAB_SIZE
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True


class RecordingFiller:
    """Stands in for :class:`BitmaskFiller` (which needs real xgrammar matchers: covered in
    test_grammar.py): an all-allowed bitmask, and which states each step asked for."""

    def __init__(self) -> None:
        self.calls: list[list[RecordingGrammar]] = []

    def submit(self, states: list[RecordingGrammar]) -> torch.Tensor:
        self.calls.append(list(states))
        return torch.full((len(states), (VOCAB_SIZE + 31) // 32), -1, dtype=torch.int32)


def _harness(config: SchedulerConfig, repetitive: bool = False) -> tuple[Harness, RecordingFiller]:
    h = Harness(config, repetitive=repetitive)
    filler = RecordingFiller()
    h.sched._mask_filler = cast(BitmaskFiller, filler)
    return h, filler


def _cfg(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "num_blocks": 6,
        "block_size": 4,
        "max_batch_prefill_tokens": 64,
        "growth_reserve_ratio": 0.0,
    }
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def test_matcher_follows_output_tokens_across_preemption() -> None:
    h, filler = _harness(_cfg())
    grammars = {}
    for name in ("a", "b", "c"):
        req = h.add(name, [ord(name)] * 4, max_new_tokens=8)
        grammars[name] = RecordingGrammar()
        req.grammar = cast(GrammarState, grammars[name])
    for _ in range(6):
        h.step()
    assert h.reqs["c"].status is RequestStatus.PREEMPTED
    h.run()
    for name in ("a", "b", "c"):
        assert grammars[name].accepted == h.reqs[name].output_token_ids, name
        assert len(h.reqs[name].output_token_ids) == 8
    for step in h.steps:
        sampling = [c.req_id for c in step.chunks if c.sample]
        assert list(step.grammar_req_ids) == sampling
        if sampling:
            assert isinstance(step.grammar_bitmask, torch.Tensor)
            assert step.grammar_bitmask.shape == (len(sampling), (VOCAB_SIZE + 31) // 32)
        else:
            assert step.grammar_bitmask is None
    # One fill call per step with a constrained sampling row, for all of them at once.
    assert len(filler.calls) == sum(1 for s in h.steps if s.grammar_req_ids)
    h.assert_all_blocks_free()


def test_constrained_rows_get_no_drafts_and_unconstrained_steps_no_bitmask() -> None:
    h, _ = _harness(_cfg(num_blocks=64, num_speculative_tokens=4), repetitive=True)
    constrained = h.add("g", [1, 2, 1, 2, 1, 2], max_new_tokens=12)
    constrained.grammar = cast(GrammarState, RecordingGrammar())
    h.add("free", [1, 2, 1, 2, 1, 2], max_new_tokens=12)
    h.run()
    chunks = [c for s in h.steps for c in s.chunks]
    assert all(c.num_draft_tokens == 0 for c in chunks if c.req_id == "g")
    assert any(c.num_draft_tokens > 0 for c in chunks if c.req_id == "free")
    h2 = Harness(_cfg(num_blocks=64))
    h2.add("free", [1, 2, 3], max_new_tokens=4)
    h2.run()
    assert all(s.grammar_bitmask is None and not s.grammar_req_ids for s in h2.steps)


def test_bitmask_stays_on_rank_0() -> None:
    """Only rank 0 samples: the step broadcast to tensor-parallel workers leaves the mask out."""
    from genserve.step import ScheduledChunk, SchedulerOutput
    from genserve.worker.shard_messages import StepMessage, decode, encode

    step = SchedulerOutput(
        step_id=3,
        chunks=(ScheduledChunk("g", (5,), 4, (0,), True),),
        grammar_bitmask=torch.full((1, 2), -1, dtype=torch.int32),
        grammar_req_ids=("g",),
    )
    kind, payload = encode(StepMessage(step))
    assert b"grammar" not in payload
    received = decode(kind, payload)
    assert isinstance(received, StepMessage)
    assert received.step.chunks == step.chunks
    assert received.step.grammar_bitmask is None and received.step.grammar_req_ids == ()
