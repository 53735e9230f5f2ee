"""Engine host time per step, on and off the runner's critical path (issue #29).

Serves ``--rows`` concurrent greedy requests of a tiny random Llama (float32, CPU) through
the real :class:`~genserve.engine.async_engine.AsyncEngine`, scheduler and model runner, and
reports per decode step:

* ``host_ms`` — the engine loop's own work (its own thread since issue #29's engine thread;
  the event-loop thread before): scheduling, applying the runner's result (stop
  conditions), detokenising and handing the outputs over (observers before the thread);
* ``gap_ms`` — how long the runner thread sat idle between the end of one step and the
  start of the next: the host work that is on the critical path.  Without overlap it is all
  of ``host_ms``; with steps scheduled ahead the next step is already queued, so it is the
  thread hand-off alone;
* ``step_ms`` — wall time per step.

Usage: ``python -m genserve.bench.engine_host --rows 1 64 [--overlap [--split]] [--tokens 48]
[--freeze-gc] [--no-cpu-kernels]`` (``--split``: the runner's launch/collect, so the step
thread launches step n + 1 before it collects step n; ``gap_ms`` then counts the thread's
idle time between all its calls).  Uses
only APIs that existed before overlapped scheduling, so the same module measures an older
checkout (``PYTHONPATH`` pointing at it) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from genserve.engine.async_engine import AsyncEngine
from genserve.engine.outputs import GenerationRequest
from genserve.engine.request import StoppingCriteria
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.model.loader import ResolvedModel
from genserve.step import RunnerOutput, SamplingParams, SchedulerOutput
from genserve.testing.tiny_model import make_tiny_model
from genserve.tokenizer import Tokenizer
from genserve.worker.model_runner import ModelRunner

BLOCK_SIZE = 16


class _TimedRunner:
    """The model runner, recording when each of its calls started and ended in the step
    thread (``spans``, disjoint: one thread) and how many steps it ran.  ``split``: offer
    the runner's ``launch`` / ``collect`` (the overlapping engine then launches step n + 1
    before collecting step n), where it has them."""

    def __init__(self, runner: ModelRunner, split: bool = False) -> None:
        self.runner = runner
        self.supports_token_from_last_step = getattr(runner, "supports_token_from_last_step", False)
        self.spans: list[tuple[float, float]] = []
        self.steps = 0
        if split and hasattr(runner, "launch"):
            self.launch = self._launch
            self.collect = self._collect

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        started = time.perf_counter()
        out = self.runner.execute_model(step)
        self.spans.append((started, time.perf_counter()))
        self.steps += 1
        return out

    def _launch(self, step: SchedulerOutput) -> Any:
        started = time.perf_counter()
        launched = self.runner.launch(step)  # type: ignore[attr-defined]
        self.spans.append((started, time.perf_counter()))
        return launched

    def _collect(self, launched: Any) -> RunnerOutput:
        started = time.perf_counter()
        out: RunnerOutput = self.runner.collect(launched)  # type: ignore[attr-defined]
        self.spans.append((started, time.perf_counter()))
        self.steps += 1
        return out

    def shutdown(self) -> None:
        pass


def _timed(obj: Any, name: str, totals: dict[str, float]) -> None:
    """Wrap ``obj.name`` so that its time adds to ``totals[name]``."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - started

    setattr(obj, name, wrapper)


async def _measure(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    rows: int,
    tokens: int,
    overlap: bool,
    split: bool = False,
) -> dict[str, float]:
    num_blocks = rows * (-(-(8 + tokens) // BLOCK_SIZE) + 1)
    runner.initialize_kv_cache(num_blocks, BLOCK_SIZE)
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE))
    timed = _TimedRunner(runner, split)
    engine = AsyncEngine(sched, timed, tokenizer, overlap=overlap)
    totals: dict[str, float] = {}
    _timed(sched, "schedule", totals)
    _timed(sched, "update_from_output", totals)
    # The engine thread's detokenising and hand-off (older checkouts: on the engine itself).
    _timed(getattr(engine, "_core", engine), "_emit_step", totals)
    engine.start()

    async def one(i: int) -> None:
        prompt = tuple(100 + (i * 7 + j) % 900 for j in range(8))
        req = GenerationRequest(
            f"r{i}", prompt, SamplingParams(), StoppingCriteria(tokens), skip_special_tokens=False
        )
        async for _ in engine.generate(req):
            pass

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(rows)))
    elapsed = time.perf_counter() - started
    await engine.shutdown(grace_s=0.0)
    spans = timed.spans
    steps = timed.steps
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    return {
        "rows": rows,
        "overlap": overlap,
        "split": split and hasattr(timed, "launch"),
        "steps": steps,
        "host_ms": 1000 * sum(totals.values()) / steps,
        "schedule_ms": 1000 * totals.get("schedule", 0.0) / steps,
        "update_ms": 1000 * totals.get("update_from_output", 0.0) / steps,
        "emit_ms": 1000 * totals.get("_emit_step", 0.0) / steps,
        "gap_ms": 1000 * sum(gaps) / max(steps - 1, 1),
        "runner_ms": 1000 * sum(b - a for a, b in spans) / steps,
        "step_ms": 1000 * elapsed / steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--overlap", action="store_true")
    parser.add_argument(
        "--split",
        action="store_true",
        help="with --overlap: the runner's launch/collect (launch n + 1 before collecting n)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per row count (best kept)")
    parser.add_argument(
        "--freeze-gc",
        action="store_true",
        help="gc.freeze() after start-up, as the server does since issue #29's engine work",
    )
    parser.add_argument(
        "--no-cpu-kernels",
        action="store_true",
        help="torch's ops only (no kernel build: compares checkouts whose builds differ)",
    )
    args = parser.parse_args(argv)
    if args.no_cpu_kernels:
        from genserve.kernels import cpu as cpu_kernels

        cpu_kernels.configure(enabled=False)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp), "llama", 0)
        runner = ModelRunner(ResolvedModel(model_dir, "tiny"), torch.float32, torch.device("cpu"))
        tokenizer = Tokenizer(model_dir)
        if args.freeze_gc:  # plain gc calls: the flag works on older checkouts too
            gc.collect()
            gc.freeze()
        for rows in args.rows:
            runs = [
                asyncio.run(
                    _measure(runner, tokenizer, rows, args.tokens, args.overlap, args.split)
                )
                for _ in range(args.repeats)
            ]
            print(json.dumps(min(runs, key=lambda r: r["step_ms"])))


if __name__ == "__main__":
    main()
