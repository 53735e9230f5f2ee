"""Server CPU time per streamed token over real gRPC, split by thread (issues #28, #29).

Starts a real ``genserve`` process (by default on a tiny random Llama, float32, CPU, one
torch thread, so the model's own time is small and the host's per-token cost shows), drives
it with N concurrent closed-loop ``GenerateStream`` clients running in ``--client-processes``
OTHER processes, and over a measurement window reads the server's per-thread CPU time
(utime + stime from ``/proc/PID/task/*/stat``).  It reports, per level:

* ``tokens_per_s`` — streamed messages received by the clients in the window;
* ``server_cpu_us_per_token`` — the whole server process's CPU time per streamed token;
* ``grpc_loop_cpu_us_per_token`` — the main thread's, where the grpc.aio event loop (the
  servicer, interceptors, protobuf building, grpc's Python-side callbacks) runs;
* ``other_cpu_us_per_token`` — every other thread (the engine thread, the step thread,
  grpc's native threads, and with ``--engine-process`` every thread of the engine process,
  named ``engine:...``), with the busiest threads listed by id and name;
* ``client_cpu_util`` — each load process's CPU time / window (near 1.0: that client
  process saturates a core and the throughput is the client's, not the server's; the
  per-token CPU numbers stay meaningful).

Usage::

    python -m genserve.bench.stream_host --streams 64 256 [--new-tokens 64]
        [--client-processes 2] [--warmup-s 4] [--measure-s 8] [--out FILE.json]
        [--model-id DIR] [-- extra genserve arguments]

With ``--model-id`` it serves that model instead (on a GPU machine: ``-- --dtype bfloat16``
and whatever the model needs); the numbers are the same kind.  Only loopback is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from genserve.bench.launch import LaunchedServer, split_server_args
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running"


# ---------------------------------------------------------------------- /proc readings
@dataclass(frozen=True, slots=True)
class ThreadTime:
    tid: int
    name: str
    cpu_s: float  # utime + stime


def thread_times(pid: int) -> dict[int, ThreadTime]:
    """CPU seconds of every thread of ``pid`` now (threads that exit meanwhile are skipped)."""
    out: dict[int, ThreadTime] = {}
    task_dir = Path(f"/proc/{pid}/task")
    for entry in task_dir.iterdir():
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        # fields[0] is stat's 3rd field (state): utime and stime are its 14th and 15th.
        cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
        tid = int(entry.name)
        out[tid] = ThreadTime(tid, name, cpu)
    return out


def tree_thread_times(pid: int) -> dict[int, ThreadTime]:
    """:func:`thread_times` of ``pid`` and of every process below it (the engine process of
    ``--engine-process``, whose threads are named ``engine:NAME``)."""
    out = thread_times(pid)
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for child in children:
                pending.append(child)
                try:
                    times = thread_times(child)
                except OSError:  # exited meanwhile
                    continue
                for tid, t in times.items():
                    out[tid] = ThreadTime(tid, f"engine:{t.name}", t.cpu_s)
    return out


def cpu_between(
    pid: int, before: dict[int, ThreadTime], after: dict[int, ThreadTime]
) -> list[ThreadTime]:
    """Per-thread CPU seconds spent between two readings, busiest first."""
    spent = []
    for tid, now in after.items():
        start = before[tid].cpu_s if tid in before else 0.0
        spent.append(ThreadTime(tid, now.name, now.cpu_s - start))
    return sorted(spent, key=lambda t: -t.cpu_s)


# ---------------------------------------------------------------------- the load processes
def _client_process(
    address: str, streams: int, new_tokens: int, t0: float, t1: float, results: Any
) -> None:
    """A load process: ``streams`` closed-loop streams until ``t1`` (wall clock); counts the
    messages received in [t0, t1) and its own CPU time in that window."""
    results.put(asyncio.run(_client_main(address, streams, new_tokens, t0, t1)))


async def _client_main(
    address: str, streams: int, new_tokens: int, t0: float, t1: float
) -> dict[str, float]:
    counted = 0
    errors = 0
    params = pb.GenerateParameters(max_new_tokens=new_tokens, ignore_eos=True)
    request = pb.GenerateStreamRequest(inputs=_PROMPT, parameters=params)
    cpu: dict[str, float] = {}

    async def stream_loop(stub: pb_grpc.TextGenerationServiceStub) -> None:
        nonlocal counted, errors
        while time.time() < t1:
            try:
                async for _ in stub.GenerateStream(request, timeout=120):
                    now = time.time()
                    if t0 <= now < t1:
                        counted += 1
            except grpc.aio.AioRpcError:
                errors += 1
                await asyncio.sleep(0.1)

    async def clock() -> None:
        await asyncio.sleep(max(0.0, t0 - time.time()))
        cpu["start"] = time.process_time()
        await asyncio.sleep(max(0.0, t1 - time.time()))
        cpu["end"] = time.process_time()

    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        await asyncio.gather(clock(), *(stream_loop(stub) for _ in range(streams)))
    return {
        "tokens": counted,
        "errors": errors,
        "cpu_util": (cpu["end"] - cpu["start"]) / (t1 - t0),
    }


# ---------------------------------------------------------------------- one level
@dataclass(frozen=True, slots=True)
class LevelResult:
    streams: int
    client_processes: int
    window_s: float
    tokens: int
    tokens_per_s: float
    server_cpu_us_per_token: float
    grpc_loop_cpu_us_per_token: float
    other_cpu_us_per_token: float
    server_cpu_util: float  # process CPU seconds / window (cores busy)
    grpc_loop_util: float  # the main thread's share of one core
    client_cpu_util: list[float]
    errors: int
    busiest_threads: list[dict[str, Any]]


def run_level(
    pid: int,
    address: str,
    streams: int,
    new_tokens: int,
    client_processes: int,
    warmup_s: float,
    measure_s: float,
    py_spy: Path | None = None,
    py_spy_out: Path | None = None,
) -> LevelResult:
    """One measurement at ``streams`` concurrent streams against server process ``pid``;
    with ``py_spy`` (the py-spy executable), ``py-spy record --gil`` samples the window into
    ``py_spy_out`` (collapsed stacks; its sampling costs the server some CPU too)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    start = time.time() + 3.0  # the spawned clients import grpc first
    t0, t1 = start + warmup_s, start + warmup_s + measure_s
    shares = [
        streams // client_processes + (k < streams % client_processes)
        for k in range(client_processes)
    ]
    procs = [
        ctx.Process(target=_client_process, args=(address, n, new_tokens, t0, t1, results))
        for n in shares
        if n > 0
    ]
    for p in procs:
        p.start()
    time.sleep(max(0.0, t0 - time.time()))
    spy = None
    if py_spy is not None and py_spy_out is not None:
        command = [str(py_spy), "record", "--gil", "--nonblocking", "--format", "raw"]
        command += ["--rate", "200", "--duration", str(int(measure_s)), "--pid", str(pid)]
        spy = subprocess.Popen(
            [*command, "-o", str(py_spy_out)],
            stdout=subprocess.DEVNULL,
            stderr=py_spy_out.with_suffix(".log").open("wb"),
        )
    before = tree_thread_times(pid)
    time.sleep(max(0.0, t1 - time.time()))
    after = tree_thread_times(pid)
    if spy is not None:
        spy.wait(timeout=60)
    client = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=120)
    spent = cpu_between(pid, before, after)
    window = t1 - t0
    tokens = sum(int(c["tokens"]) for c in client)
    total = sum(t.cpu_s for t in spent)
    main = sum(t.cpu_s for t in spent if t.tid == pid)
    per_token = 1e6 / max(tokens, 1)
    return LevelResult(
        streams=streams,
        client_processes=len(procs),
        window_s=window,
        tokens=tokens,
        tokens_per_s=tokens / window,
        server_cpu_us_per_token=total * per_token,
        grpc_loop_cpu_us_per_token=main * per_token,
        other_cpu_us_per_token=(total - main) * per_token,
        server_cpu_util=total / window,
        grpc_loop_util=main / window,
        client_cpu_util=[round(c["cpu_util"], 3) for c in client],
        errors=sum(int(c["errors"]) for c in client),
        busiest_threads=[
            {"tid": t.tid, "name": t.name, "main": t.tid == pid, "cpu_s": round(t.cpu_s, 3)}
            for t in spent[:5]
            if t.cpu_s > 0
        ],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_args(model: Path, max_streams: int, extra: list[str]) -> list[str]:
    args = [
        "--model-id",
        str(model),
        "--max-concurrent-requests",
        str(max(max_streams * 2, 64)),
        "--max-batch-size",
        str(max_streams),
    ]
    return args + extra


def main(argv: Sequence[str] | None = None) -> None:
    own, server_extra = split_server_args(
        list(argv) if argv is not None else __import__("sys").argv[1:]
    )
    parser = argparse.ArgumentParser(prog="python -m genserve.bench.stream_host")
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--measure-s", type=float, default=8.0)
    parser.add_argument("--threads", type=int, default=1, help="server OMP_NUM_THREADS")
    parser.add_argument("--model-id", type=Path, help="default: a tiny random Llama")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--py-spy",
        type=Path,
        help="py-spy executable: record --gil each window into --out's folder (or .)",
    )
    args = parser.parse_args(own)
    with tempfile.TemporaryDirectory(prefix="stream-host-") as scratch:
        model = args.model_id
        if model is None:
            from genserve.testing.tiny_model import make_tiny_model

            model = make_tiny_model(Path(scratch) / "model")
        port = _free_port()
        server = LaunchedServer(
            _server_args(model, max(args.streams), server_extra),
            "127.0.0.1",
            port,
            args.threads,
            Path(scratch) / "server.log",
        )
        with server:
            asyncio.run(server.wait_healthy(600))
            assert server.pid is not None
            results = []
            for streams in args.streams:
                result = run_level(
                    server.pid,
                    server.address,
                    streams,
                    args.new_tokens,
                    max(1, args.client_processes),
                    args.warmup_s,
                    args.measure_s,
                    args.py_spy,
                    (args.out.parent if args.out else Path(".")) / f"py-spy-gil-c{streams}.txt",
                )
                results.append(asdict(result))
                print(json.dumps(results[-1]), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
