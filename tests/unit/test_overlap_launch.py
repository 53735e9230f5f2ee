"""Launch step n + 1 before reading back step n (issue #29), proven on the CPU.

The runner runs its CUDA code path on the CPU (the harness of test_gpu_step_sync_free.py:
bfloat16, CPU kernels off, explicit transfers, decode steps replayed from DecodeGraphs'
static buffers) and is driven as an overlapping engine's step thread drives it: launch
step n + 1, then collect step n.  Asserted, in the order the calls are issued (one thread:
no timing involved): each placeholder step's graph replay is issued before the previous
step's readback is waited on; each step waits once and copies back once (SyncAudit); its
placeholder tokens are written on the device (an ``index_copy_`` into the graph's token
input, outside the graphs); no value is read on the host otherwise; and the tokens equal
the serial run's with the tokens known on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from genserve.model.loader import ResolvedModel
from genserve.step import RunnerOutput, SamplingParams, ScheduledChunk, SchedulerOutput
from genserve.worker import device_io
from genserve.worker.cuda_graphs import DecodeGraphs
from genserve.worker.launched_step import LaunchedStep
from genserve.worker.model_runner import ModelRunner
from genserve.worker.sync_audit import SyncAudit
from tests.conftest import TinyModelFactory
from tests.unit.test_gpu_step_sync_free import GREEDY, SAMPLED, _runner
from tests.unit.test_gpu_step_sync_free import cuda_path_on_cpu as cuda_path_on_cpu  # fixture
from tests.unit.test_sampling_table import _Stream

NUM_ROWS = 8
NUM_STEPS = 5


def _decode(stream: _Stream, step_id: int, placeholders: bool) -> SchedulerOutput:
    """The stream's next decode step; with ``placeholders`` its tokens are not known yet
    (the previous step is launched, not collected)."""
    n = len(stream.tokens[0]) + (1 if placeholders else 0)
    chunks = tuple(
        ScheduledChunk(
            f"r{i}",
            (0,) if placeholders else (stream.tokens[i][-1],),
            len(p) + n - 1,
            (i,),
            True,
            token_from_last_step=placeholders,
        )
        for i, p in enumerate(stream.prompts)
    )
    return SchedulerOutput(step_id, chunks)


def _record(stream: _Stream, out: RunnerOutput) -> None:
    for s in out.sampled:
        stream.tokens[int(s.req_id[1:])].append(s.token_id)


def _pipelined(
    runner: ModelRunner, params: SamplingParams, events: list[str]
) -> tuple[list[list[int]], Any]:
    """NUM_STEPS decode steps, each launched before the one before it is collected (the
    first with known tokens, the others with placeholders), under a SyncAudit."""
    stream = _Stream(runner, NUM_ROWS, params)
    stream.decode(False)  # one-time allocations (readback buffers, index tensors)
    graphs = runner._graphs
    assert graphs is not None
    launch, collect = runner.launch, runner.collect
    with SyncAudit(layer=runner.model._layers[1], graphs=graphs) as audit:
        events.append("launch 1")
        prev: LaunchedStep = launch(_decode(stream, 1, placeholders=False))
        for k in range(2, NUM_STEPS + 1):
            events.append(f"launch {k}")
            launched = launch(_decode(stream, k, placeholders=True))
            events.append(f"collect {k - 1}")
            _record(stream, collect(prev))
            prev = launched
        events.append(f"collect {NUM_STEPS}")
        _record(stream, collect(prev))
    return stream.tokens, audit.counts


def _spy(target: Any, name: str, label: str, events: list[str], mp: pytest.MonkeyPatch) -> None:
    original: Callable[..., Any] = getattr(target, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        events.append(label)
        return original(*args, **kwargs)

    mp.setattr(target, name, spy)


@pytest.mark.usefixtures("cuda_path_on_cpu")
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_step_n_plus_1_is_launched_before_step_n_is_read_back(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    model_dir: Path = tiny_model_factory("llama", seed=3)
    params = GREEDY if kind == "greedy" else SAMPLED
    events: list[str] = []
    runner = _runner(model_dir, explicit=True)
    _spy(DecodeGraphs, "run", "replay", events, monkeypatch)
    _spy(device_io.PendingRead, "wait", "wait", events, monkeypatch)
    tokens, counts = _pipelined(runner, params, events)
    first = events.index("launch 1")
    expected = ["launch 1", "replay"]
    for k in range(2, NUM_STEPS + 1):
        expected += [f"launch {k}", "replay", f"collect {k - 1}", "wait"]
    expected += [f"collect {NUM_STEPS}", "wait"]
    assert events[first:] == expected  # n + 1 replayed before n's one wait
    problems = {k: v for k, v in counts.details.items() if not k.startswith("kernel:")}
    assert counts.d2h == NUM_STEPS, problems  # one copy back a step
    assert counts.syncs == 0 and counts.implicit == 0 and counts.h2d_blocking == 0, problems
    # The placeholders' tokens: gathered on the device from the last step's sampled block
    # into the graph's token input, once a step.
    assert counts.details.get("outside_graph:aten.index_copy_") == NUM_STEPS - 1, problems
    # The inputs and the block table a step, and the placeholder rows' two index tensors
    # once (a steady batch reuses them).
    assert counts.h2d == 2 * NUM_STEPS + 2, problems

    # The same tokens as the serial run whose tokens are known on the host.
    serial = _Stream(_runner(model_dir, explicit=True), NUM_ROWS, params)
    for _ in range(NUM_STEPS + 1):
        serial.decode(False)
    assert tokens == serial.tokens
    assert all(len(t) == NUM_STEPS + 2 for t in tokens)


@pytest.mark.usefixtures("cuda_path_on_cpu")
def test_a_watermarked_placeholder_row_collects_the_step_before_first(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch that needs the last step's tokens on the host (the watermark hashes the
    previous token) collects that step first, and gives the serial run's tokens."""
    model_dir: Path = tiny_model_factory("llama", seed=3)
    params = SamplingParams(temperature=0.8, seed=5, watermark=True)
    events: list[str] = []
    runner = _runner(model_dir, explicit=True)
    _spy(device_io.PendingRead, "wait", "wait", events, monkeypatch)
    tokens, counts = _pipelined(runner, params, events)
    first = events.index("launch 1")
    expected = ["launch 1"]
    for k in range(2, NUM_STEPS + 1):
        expected += [f"launch {k}", "wait", f"collect {k - 1}"]  # waited inside the launch
    expected += [f"collect {NUM_STEPS}", "wait"]
    assert events[first:] == expected
    assert counts.d2h == NUM_STEPS
    serial = _Stream(_runner(model_dir, explicit=True), NUM_ROWS, params)
    for _ in range(NUM_STEPS + 1):
        serial.decode(False)
    assert tokens == serial.tokens


@pytest.mark.cuda
def test_launching_ahead_on_cuda_never_synchronises(tiny_model_factory: TinyModelFactory) -> None:
    """On a GPU: captured decode steps launched one ahead of their collect, placeholders
    gathered on the device, under sync debug "error" (the readbacks wait on events, which
    the debug mode does not count); the tokens equal the serial run's."""
    model_dir: Path = tiny_model_factory("llama", seed=3)
    device = torch.device("cuda")

    def runner() -> ModelRunner:
        r = ModelRunner(ResolvedModel(model_dir, "tiny"), torch.bfloat16, device)
        r.enable_cuda_graphs((1, 2, 4, 8), 64, 16)
        r.initialize_kv_cache(NUM_ROWS * 4 + 1, 16)
        r.warmup()
        return r

    pipelined = runner()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = _pipelined_plain(pipelined, SAMPLED)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pipelined.cuda_graph_sizes
    serial = _Stream(runner(), NUM_ROWS, SAMPLED)
    for _ in range(NUM_STEPS + 1):
        serial.decode(False)
    assert tokens == serial.tokens


def _pipelined_plain(runner: ModelRunner, params: SamplingParams) -> list[list[int]]:
    """:func:`_pipelined` without the audit (a real device)."""
    stream = _Stream(runner, NUM_ROWS, params)
    stream.decode(False)
    prev = runner.launch(_decode(stream, 1, placeholders=False))
    for k in range(2, NUM_STEPS + 1):
        launched = runner.launch(_decode(stream, k, placeholders=True))
        _record(stream, runner.collect(prev))
        prev = launched
    _record(stream, runner.collect(prev))
    return stream.tokens
