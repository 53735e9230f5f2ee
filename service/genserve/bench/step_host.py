"""Host milliseconds per runner step on the CUDA code path, measured on the CPU (issue #29).

A GPU step costs the host what Python and torch do to *launch* it; the kernels themselves run
on the device.  This runs the model runner's CUDA code path on the CPU so that nearly all
that is left is the launching: an 8B's 32 decoder layers (Llama-3.1-8B's layer count and head
grouping) with tiny widths (hidden 64, vocabulary 1,024), bfloat16, the CPU kernels off
(torch's ops, as on CUDA), explicit transfers (pinned staging, ``non_blocking`` copies), the
fused GPU layer ops (their torch references: one op each, as the Triton kernel is one
launch), and the two Triton attention kernels replaced by one op each (a copy of ``q``: the
cost of one launch, not of attention).  ``DecodeGraphs`` runs on the CPU without capture, so
the ops a GPU would replay from a graph run eagerly; their time is measured apart
(``graph_ms``) and what a GPU host does for a decode step is the rest (``outside_ms``) plus
one ``replay()`` per graph.

Per step kind it prints the median over ``--repeats`` steps of the whole ``execute_model``
(``step_ms``), the part inside the would-be graphs (``graph_ms``), the rest (``outside_ms``)
and the ops dispatched (``ops``, from a profile of one step):

* ``decode-1`` / ``decode-64`` / ``decode-256``: a greedy decode step of that many rows (on
  CUDA: replayed; ``outside_ms`` is the runner's per-row Python around the replay: laying
  out and padding the rows, staging, unpacking the readback);
* ``mixed-64`` / ``mixed-256``: that many decode rows and two fresh 40-token prompts (on
  CUDA: eager, every op launched from Python — the step kind ``--prefill-batching`` keeps
  rare).

CPU time per op includes the op's (tiny) arithmetic, and a CUDA launch adds the driver's few
microseconds (a Triton launch from Python more): read ``ops`` times a GPU host's per-launch cost
beside ``step_ms``.  Usage: ``python -m genserve.bench.step_host [--repeats 20]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import triton_attention, triton_varlen_attention
from genserve.model.attention import TorchPagedAttention
from genserve.model.loader import ResolvedModel
from genserve.step import NewRequestData, SamplingParams, ScheduledChunk, SchedulerOutput
from genserve.testing.tiny_model import make_tiny_model
from genserve.worker.cuda_graphs import DecodeGraphs
from genserve.worker.graph_plan import sampling_state
from genserve.worker.model_runner import ModelRunner

CPU = torch.device("cpu")
BLOCK_SIZE = 16
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT = 40  # the GPU bench's ~40-token prompts
# Llama-3.1-8B's layer count and grouping (32 query heads over 8 KV heads) at tiny widths.
SHAPE: dict[str, Any] = {
    "num_hidden_layers": 32,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}


def _one_launch(q: torch.Tensor, *_: object, **__: object) -> torch.Tensor:
    """Stands in for a Triton attention kernel: one op, as the kernel is one launch."""
    return q.clone()


@contextmanager
def cuda_path_on_cpu() -> Iterator[None]:
    """CPU kernels off and the Triton attention kernels replaced by one op each."""
    was = cpu_kernels._settings.enabled
    saved = (
        triton_attention.paged_decode_attention,
        triton_varlen_attention.paged_varlen_attention,
    )
    cpu_kernels.configure(enabled=False)
    triton_attention.paged_decode_attention = _one_launch  # type: ignore[assignment]
    triton_varlen_attention.paged_varlen_attention = _one_launch  # type: ignore[assignment]
    try:
        yield
    finally:
        triton_attention.paged_decode_attention, triton_varlen_attention.paged_varlen_attention = (
            saved
        )
        cpu_kernels.configure(enabled=was)


class _GraphClock:
    """Time spent in what ``DecodeGraphs`` would replay (its forward and its tails)."""

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.seconds = 0.0
        for name in ("_forward", "_greedy_tail", "_sampled_tail"):
            setattr(graphs, name, self._timed(getattr(graphs, name)))

    def _timed(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return wrapper


def build_runner(model_dir: Path, num_blocks: int) -> tuple[ModelRunner, _GraphClock]:
    """The runner on its CUDA code path (see the module docstring), graphs not captured."""
    runner = ModelRunner(
        ResolvedModel(model_dir, "tiny"), torch.bfloat16, CPU, explicit_transfers=True
    )
    runner.model.use_fused_gpu_ops(4096)
    runner.initialize_kv_cache(num_blocks + 1, BLOCK_SIZE)
    runner.warmup()
    graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        BUCKETS,
        width=16,
        block_size=BLOCK_SIZE,
        scratch_block=num_blocks,
        device=CPU,
        use_triton_decode=True,
    )
    runner._graphs = graphs
    runner._table, runner._penalties = sampling_state(
        runner.config.vocab_size, CPU, runner.io, graphs=True
    )
    graphs.bind_sampling(runner._table, runner._penalties)
    # The backend a CUDA runner resolves for --gpu-prefill-attention auto (the Triton kernel).
    runner.backend = TorchPagedAttention(
        CPU, use_triton_decode=True, batch_prompts=True, prefill="triton",
        upload=runner.io.upload_tensor,
    )  # fmt: skip
    return runner, _GraphClock(graphs)


class _Requests:
    """Requests with 16-block tables, stepped by hand (decode rows and fresh prompts)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step_id = 0
        self.lengths: dict[str, int] = {}
        self.blocks: dict[str, tuple[int, ...]] = {}

    def _blocks(self, index: int) -> tuple[int, ...]:
        return tuple(range(16 * index, 16 * index + 16))

    def admit(self, indices: range, decodes: list[str]) -> SchedulerOutput:
        """A step of ``decodes``' next tokens and fresh prompts for ``indices``."""
        news, chunks = [], [self._decode_chunk(r) for r in decodes]
        for i in indices:
            rid = f"r{i}"
            prompt = tuple(3 + (i * 37 + j * 11) % 1000 for j in range(PROMPT))
            self.blocks[rid] = self._blocks(i)
            news.append(NewRequestData(rid, prompt, PROMPT, 0, SamplingParams()))
            chunks.append(ScheduledChunk(rid, prompt, 0, self.blocks[rid], True))
        self.step_id += 1
        return SchedulerOutput(self.step_id, tuple(chunks), new_requests=tuple(news))

    def decode(self, rids: list[str], placeholders: bool = True) -> SchedulerOutput:
        self.step_id += 1
        chunks = tuple(self._decode_chunk(r, placeholders) for r in rids)
        return SchedulerOutput(self.step_id, chunks)

    def _decode_chunk(self, rid: str, placeholder: bool = True) -> ScheduledChunk:
        """A decode row as ``--overlap-scheduling`` sends it (the GPU runs' setting): a
        placeholder the runner fills with the token it sampled last (which needs ``rid``
        sampled in the step before); else an explicit token."""
        start = self.lengths[rid] - 1
        if not placeholder:
            return ScheduledChunk(rid, (5,), start, self.blocks[rid], True)
        return ScheduledChunk(rid, (0,), start, self.blocks[rid], True, token_from_last_step=True)

    def run(self, step: SchedulerOutput) -> None:
        out = self.runner.execute_model(step)
        for c in step.chunks:
            self.lengths[c.req_id] = c.start_pos + len(c.token_ids) + 1
        assert len(out.sampled) == sum(c.sample for c in step.chunks)


def _ops(run: Callable[[], None]) -> int:
    """Ops one call dispatches (CPU profiler events at the aten level)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def measure(repeats: int) -> list[dict[str, Any]]:
    """The three step kinds' host times (see the module docstring)."""
    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp, cuda_path_on_cpu():
        model_dir = make_tiny_model(Path(tmp), "llama", 0, **SHAPE)
        runner, clock = build_runner(model_dir, num_blocks=16 * (256 + 4 * repeats + 12))
        reqs = _Requests(runner)
        reqs.run(reqs.admit(range(256), []))
        rows = [f"r{i}" for i in range(256)]
        next_id = 256

        def time_steps(kind: str, make: Callable[[], SchedulerOutput]) -> None:
            totals, inside = [], []
            reqs.run(make())  # warm: first-use allocations, the bucket's first run
            for _ in range(repeats):
                step = make()
                clock.seconds = 0.0
                started = time.perf_counter()
                reqs.run(step)
                totals.append(time.perf_counter() - started)
                inside.append(clock.seconds)
            ops = _ops(lambda: reqs.run(make()))
            step_ms = 1000 * statistics.median(totals)
            graph_ms = 1000 * statistics.median(inside)
            results.append(
                {
                    "kind": kind,
                    "step_ms": round(step_ms, 2),
                    "graph_ms": round(graph_ms, 2),
                    "outside_ms": round(step_ms - graph_ms, 2),
                    "ops": ops,
                    "layers": SHAPE["num_hidden_layers"],
                }
            )

        # Largest first: a placeholder needs its request sampled in the step before, so
        # each kind's rows are a subset of the last step's.
        for n in (256, 64, 1):
            time_steps(f"decode-{n}", lambda n=n: reqs.decode(rows[:n]))  # type: ignore[misc]
        reqs.run(reqs.decode(rows, placeholders=False))  # all 256 sampled before the mixed steps

        def mixed(n: int) -> SchedulerOutput:
            nonlocal next_id
            next_id += 2
            return reqs.admit(range(next_id - 2, next_id), rows[:n])

        for n in (256, 64):
            time_steps(f"mixed-{n}", lambda n=n: mixed(n))  # type: ignore[misc]
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for row in measure(args.repeats):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
