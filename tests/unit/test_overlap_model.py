"""Overlapped scheduling through the real engine, scheduler and model runner (tiny float32
Llama on the CPU): step n + 1 is scheduled before step n's tokens are known, its decode
rows read their input tokens from step n's sampled ids on the device, and every output —
tokens, logprobs, text, finish reason — is the same as with overlap off.

Covered: greedy (with top alternatives), seeded sampling (top-k, top-p, min-p, penalties,
logit bias), a stop string, a stop token id, max tokens, a cancelled stream, preemption
(a KV cache too small for the batch), speculative decoding (steps with drafts are not
scheduled ahead) and a grammar (steps sampling a constrained request are not scheduled
ahead)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from genserve.engine.async_engine import AsyncEngine
from genserve.engine.outputs import GenerationRequest
from genserve.engine.request import FinishReason, StoppingCriteria
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.model.loader import ResolvedModel
from genserve.step import RunnerOutput, SamplingParams, SchedulerOutput
from genserve.tokenizer import Tokenizer
from genserve.worker.launched_step import LaunchedStep
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory

BLOCK_SIZE = 8


class CountingRunner:
    """The model runner, counting what the engine hands it; it splits steps into launch and
    collect as the model runner does, so with overlap the step thread launches step n + 1
    before it collects step n (``order`` records the calls)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.supports_token_from_last_step = runner.supports_token_from_last_step
        self.placeholders = 0
        self.steps: list[SchedulerOutput] = []
        self.order: list[tuple[str, int]] = []

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        self.steps.append(step)
        self.placeholders += sum(c.token_from_last_step for c in step.chunks)
        self.order.append(("execute", step.step_id))
        return self.runner.execute_model(step)

    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        self.steps.append(step)
        self.placeholders += sum(c.token_from_last_step for c in step.chunks)
        self.order.append(("launch", step.step_id))
        return self.runner.launch(step)

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        self.order.append(("collect", launched.step_id))
        return self.runner.collect(launched)

    def shutdown(self) -> None:
        pass


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[int]] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def runner(model_dir: Path) -> ModelRunner:
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cpu")
    )
    runner.initialize_kv_cache(64, BLOCK_SIZE)
    return runner


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


async def _serve(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    requests: list[GenerationRequest],
    *,
    overlap: bool,
    num_blocks: int = 64,
    block_size: int = BLOCK_SIZE,
    cancel_after: dict[str, int] | None = None,
    proposer: Any = None,
    **config: Any,
) -> tuple[dict[str, Result], CountingRunner]:
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **config))
    if proposer is not None:
        sched._proposer = proposer
    counting = CountingRunner(runner)
    engine = AsyncEngine(sched, counting, tokenizer, overlap=overlap)
    engine.start()
    cancel_after = cancel_after or {}

    async def one(req: GenerationRequest) -> Result:
        res = Result()
        async for out in engine.generate(req):
            if out.token is not None:
                res.token_ids.append(out.token.token_id)
                res.logprobs.append(round(out.token.logprob or 0.0, 4))
                res.top.append([t.token_id for t in out.top_tokens])
                res.text += out.token.text
            if out.final is not None:
                res.finish = out.final.finish_reason
            if len(res.token_ids) == cancel_after.get(req.req_id, -1):
                break  # the client goes away
        return res

    results = await asyncio.gather(*(one(r) for r in requests))
    await engine.shutdown(grace_s=0.0)
    assert sched.kv.num_free_blocks == num_blocks  # every block came back
    return {r.req_id: res for r, res in zip(requests, results, strict=True)}, counting


def _motif_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    motif = torch.randint(300, 2000, (6,), generator=gen).tolist()
    loose = torch.randint(300, 2000, (40,), generator=gen).tolist()
    # Repeated motifs: the n-gram proposer finds drafts from the first decode step.
    return [motif * 5, loose[:13], motif * 2 + loose[:7], loose[5:30], loose[::3], motif * 3]


SAMPLING = [
    SamplingParams(num_top_tokens=2),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7),
    SamplingParams(
        temperature=1.1,
        min_p=0.02,
        seed=8,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        logit_bias=((500, 2.0), (501, -3.0)),
    ),
    SamplingParams(temperature=0.7, top_p=0.8, seed=9, num_top_tokens=1),
    SamplingParams(),
    SamplingParams(temperature=0.8, typical_p=0.9, seed=10, frequency_penalty=0.2),
]


def _requests(
    max_new: int = 14, change: Callable[[int, dict[str, Any]], None] | None = None
) -> list[GenerationRequest]:
    reqs = []
    for i, (prompt, params) in enumerate(zip(_motif_prompts(), SAMPLING, strict=True)):
        kw: dict[str, Any] = {"max_new": max_new, "stop": (), "stop_ids": frozenset()}
        if change is not None:
            change(i, kw)
        reqs.append(
            GenerationRequest(
                f"r{i}",
                tuple(prompt),
                params,
                StoppingCriteria(kw["max_new"], stop_token_ids=kw["stop_ids"]),
                stop=kw["stop"],
                seed=params.seed or None,
                grammar=kw.get("grammar"),
                skip_special_tokens=False,
            )
        )
    return reqs


def _assert_same(on: dict[str, Result], off: dict[str, Result], kw: Any) -> None:
    """Tokens, text, alternatives and finish reasons equal; logprobs within 1e-3.  Requests
    reach the engine thread through its inbox, so a burst sent together may join over two
    steps in one run and one step in the other: the batch's shapes, and with them float32
    rounding in the last digits of a logprob, can differ while no token does."""
    assert on.keys() == off.keys(), kw
    for req_id, a in on.items():
        b = off[req_id]
        assert (a.token_ids, a.top, a.text, a.finish) == (b.token_ids, b.top, b.text, b.finish), (
            req_id,
            kw,
        )
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3), (req_id, kw)


def _both(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    requests: Callable[[], list[GenerationRequest]],
    **kw: Any,
) -> tuple[dict[str, Result], CountingRunner, CountingRunner]:
    off, off_runner = asyncio.run(_serve(runner, tokenizer, requests(), overlap=False, **kw))
    on, on_runner = asyncio.run(_serve(runner, tokenizer, requests(), overlap=True, **kw))
    _assert_same(on, off, kw)
    assert off_runner.placeholders == 0
    return off, off_runner, on_runner


def _assert_launched_ahead(order: list[tuple[str, int]]) -> None:
    """Every step launched once and collected once, after its launch and in launch order;
    with steps scheduled ahead, step n + 1's launch comes before step n's collect (the
    order of the step thread's calls: the engine queues them so, no timing involved)."""
    launches = [step for call, step in order if call == "launch"]
    collects = [step for call, step in order if call == "collect"]
    assert launches == collects and len(set(launches)) == len(launches)
    ahead = 0
    for i, (call, step) in enumerate(order):
        if call == "collect":
            assert ("launch", step) in order[:i]
            later = [s for c, s in order[:i] if c == "launch" and s > step]
            ahead += bool(later)
    assert ahead >= 5, order  # launched before the step before it was collected


def test_overlap_reproduces_every_stop_and_sampling_kind(
    runner: ModelRunner, tokenizer: Tokenizer
) -> None:
    plain, off_runner, on_runner = _both(runner, tokenizer, _requests)
    assert on_runner.placeholders > 20  # the steps were really scheduled ahead
    assert {call for call, _ in off_runner.order} == {"execute"}
    _assert_launched_ahead(on_runner.order)
    assert all(r.finish is FinishReason.LENGTH for r in plain.values())
    stop_text = plain["r1"].text[len(plain["r1"].text) // 2 :][:3]
    stop_id = plain["r2"].token_ids[5]
    assert stop_text

    def change(i: int, kw: dict[str, Any]) -> None:
        if i == 1:
            kw["stop"] = (stop_text,)
        elif i == 2:
            kw["stop_ids"] = frozenset({stop_id})
        elif i == 3:
            kw["max_new"] = 3

    def requests() -> list[GenerationRequest]:
        return _requests(change=change)

    for kw in ({}, {"num_blocks": 14}, {"cancel_after": {"r4": 2, "r0": 5}}):
        out, _, _ = _both(runner, tokenizer, requests, **kw)
        assert out["r1"].finish is FinishReason.STOP_SEQUENCE
        assert out["r2"].finish is FinishReason.STOP_SEQUENCE
        assert out["r2"].token_ids[-1] == stop_id and len(out["r2"].token_ids) <= 6
        assert len(out["r3"].token_ids) == 3
        assert out["r5"].token_ids == plain["r5"].token_ids
        if kw.get("num_blocks"):  # preemption happened and changed nothing
            assert out["r0"].token_ids == plain["r0"].token_ids
        if kw.get("cancel_after"):
            assert len(out["r4"].token_ids) == 2 and out["r4"].finish is None


class OracleProposer:
    """Drafts the true continuation (from a run without speculation), every third
    proposal's second draft corrupted: drafts are accepted in full, in part or not at all."""

    def __init__(self, truth: dict[str, list[int]]) -> None:
        self.truth = truth
        self.calls = 0

    def propose(
        self, req_id: str, prompt: list[int], output: list[int], max_tokens: int
    ) -> tuple[int, ...]:
        self.calls += 1
        draft = list(self.truth[req_id][len(output) : len(output) + max_tokens])
        if self.calls % 3 == 0 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % 1000
        return tuple(draft)

    def forget(self, req_id: str) -> None:
        pass


@pytest.mark.parametrize("max_batch", [8, 3])
def test_speculation_turns_scheduling_ahead_off_while_it_drafts(
    runner: ModelRunner, tokenizer: Tokenizer, max_batch: int
) -> None:
    """Speculation needs every token to propose drafts: while the batch is small enough to
    speculate nothing is scheduled ahead; with 6 requests and a limit of 3, the batch
    overlaps until requests finish and it shrinks to 3."""
    plain, _, _ = _both(runner, tokenizer, _requests)

    def requests() -> list[GenerationRequest]:
        def change(i: int, kw: dict[str, Any]) -> None:
            kw["max_new"] = 6 + 3 * i  # requests end at different steps: the batch shrinks

        return _requests(change=change)

    truth = {r: res.token_ids for r, res in plain.items()}
    spec = {"num_speculative_tokens": 3, "speculate_max_batch_size": max_batch}
    base, _, _ = _both(runner, tokenizer, requests)
    out, _, on_runner = _both(runner, tokenizer, requests, proposer=OracleProposer(truth), **spec)
    # Speculation changes no token (logprobs may differ in the last digits: drafts change
    # the batch's shapes, and with them float32 rounding).
    assert {r: (v.token_ids, v.finish) for r, v in out.items()} == {
        r: (v.token_ids, v.finish) for r, v in base.items()
    }
    steps = on_runner.steps
    assert any(c.num_draft_tokens for s in steps for c in s.chunks)
    for before, after in itertools.pairwise(steps):
        if any(c.num_draft_tokens for c in before.chunks):
            assert not any(c.token_from_last_step for c in after.chunks)
    assert (on_runner.placeholders > 0) == (max_batch < len(SAMPLING))


def test_grammar_steps_are_not_scheduled_ahead(runner: ModelRunner, tokenizer: Tokenizer) -> None:
    pytest.importorskip("xgrammar")
    from genserve.engine.grammar import GrammarCompiler
    from genserve.engine.grammar_spec import GrammarSpec

    compiler = GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
    grammar = compiler.compile_sync(GrammarSpec.choice(["yes please", "no thanks"]))

    def requests() -> list[GenerationRequest]:
        def change(i: int, kw: dict[str, Any]) -> None:
            if i == 4:
                kw["grammar"] = grammar
                kw["max_new"] = 8
                kw["stop_ids"] = frozenset(tokenizer.eos_token_ids)

        return _requests(change=change)

    out, _, on_runner = _both(runner, tokenizer, requests)
    assert out["r4"].text in ("yes please", "no thanks"), out["r4"]
    for before, after in itertools.pairwise(on_runner.steps):
        if before.grammar_req_ids:
            assert not any(c.token_from_last_step for c in after.chunks)
    # Once the constrained request ended, the others were scheduled ahead again.
    assert on_runner.placeholders > 0
    compiler.shutdown()
