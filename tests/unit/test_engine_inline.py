"""Steps run on the engine thread (``EngineLoop.inline``): without overlap, a runner that
says ``steps_inline`` (the model runner on the CPU) is called on the engine thread itself
instead of a step thread, saving two thread hand-offs a step.  Outputs are the same as
through the step thread (real engine, scheduler and tiny float32 Llama), requests that
arrive or leave mid-generation are taken in between steps, and a step that raises fails
its requests while the engine serves on."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

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
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory

BLOCK_SIZE = 8


class ThreadRecordingRunner:
    """The model runner, recording the thread each step runs on; ``inline`` is what it
    answers for ``steps_inline``; ``fail_step``: the step id whose call raises."""

    def __init__(self, runner: ModelRunner, inline: bool, fail_step: int = -1) -> None:
        self.runner = runner
        self.steps_inline = inline
        self.fail_step = fail_step
        self.threads: set[str] = set()

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        self.threads.add(threading.current_thread().name)
        if step.step_id == self.fail_step:
            raise RuntimeError("injected step failure")
        return self.runner.execute_model(step)

    def shutdown(self) -> None:
        pass


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    error: str | None = None


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


def _request(req_id: str, prompt: list[int], max_new: int, **params: object) -> GenerationRequest:
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    return GenerationRequest(
        req_id,
        tuple(prompt),
        sampling,
        StoppingCriteria(max_new),
        seed=sampling.seed or None,
        skip_special_tokens=False,
    )


def _requests() -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(300, 2000, (40,), generator=gen).tolist()
    return [
        _request("greedy", ids[:11], 12, num_top_tokens=2),
        _request("sampled", ids[7:30], 10, temperature=0.8, top_p=0.9, seed=4),
        _request("late", ids[::3], 8),  # arrives while "greedy" generates
        _request("cancelled", ids[20:], 12),  # the client leaves after 4 tokens
    ]


async def _serve(
    runner: ModelRunner, tokenizer: Tokenizer, wrapped: ThreadRecordingRunner
) -> dict[str, Result]:
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE))
    engine = AsyncEngine(sched, wrapped, tokenizer, overlap=False)
    engine.start()
    started = asyncio.Event()

    async def one(req: GenerationRequest) -> Result:
        if req.req_id == "late":
            await started.wait()
        res = Result()
        async for out in engine.generate(req):
            if out.token is not None:
                res.token_ids.append(out.token.token_id)
                res.text += out.token.text
            if len(res.token_ids) == 3:
                started.set()
            if out.final is not None:
                res.finish, res.error = out.final.finish_reason, out.final.error
            if req.req_id == "cancelled" and len(res.token_ids) == 4:
                break
        return res

    reqs = _requests()
    results = await asyncio.gather(*(one(r) for r in reqs))
    await engine.shutdown(grace_s=0.0)
    assert sched.kv.num_free_blocks == 64  # every block came back
    return {r.req_id: res for r, res in zip(reqs, results, strict=True)}


def test_the_cpu_model_runner_runs_its_steps_inline(runner: ModelRunner) -> None:
    assert runner.steps_inline


def test_inline_steps_give_the_step_threads_outputs_on_the_engine_thread(
    runner: ModelRunner, tokenizer: Tokenizer
) -> None:
    inline = ThreadRecordingRunner(runner, inline=True)
    threaded = ThreadRecordingRunner(runner, inline=False)
    got = asyncio.run(_serve(runner, tokenizer, inline))
    want = asyncio.run(_serve(runner, tokenizer, threaded))
    assert inline.threads == {"genserve-engine"}
    assert threaded.threads and all(t.startswith("genserve-step") for t in threaded.threads)
    for req_id, res in want.items():
        assert (got[req_id].token_ids, got[req_id].text) == (res.token_ids, res.text), req_id
        assert got[req_id].finish == res.finish, req_id
    assert len(got["greedy"].token_ids) == 12 and got["greedy"].finish == FinishReason.LENGTH
    assert len(got["late"].token_ids) == 8
    assert len(got["cancelled"].token_ids) == 4


def test_an_inline_step_that_raises_fails_its_requests_and_the_engine_serves_on(
    runner: ModelRunner, tokenizer: Tokenizer
) -> None:
    async def serve() -> tuple[Result, Result]:
        sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=BLOCK_SIZE))
        wrapped = ThreadRecordingRunner(runner, inline=True, fail_step=3)
        engine = AsyncEngine(sched, wrapped, tokenizer, overlap=False)
        engine.start()

        async def one(req: GenerationRequest) -> Result:
            res = Result()
            async for out in engine.generate(req):
                if out.token is not None:
                    res.token_ids.append(out.token.token_id)
                if out.final is not None:
                    res.finish, res.error = out.final.finish_reason, out.final.error
            return res

        failed = await one(_request("first", [400, 401, 402, 403], 10))
        after = await one(_request("second", [410, 411, 412], 5))
        await engine.shutdown(grace_s=0.0)
        assert sched.kv.num_free_blocks == 64
        return failed, after

    failed, after = asyncio.run(serve())
    assert failed.finish == FinishReason.ERROR and "injected step failure" in (failed.error or "")
    assert len(failed.token_ids) < 10
    assert after.finish == FinishReason.LENGTH and len(after.token_ids) == 5
