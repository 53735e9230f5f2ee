"""--engine-process with tensor parallelism (issue #29), gloo on CPU, through real servers:
the engine process is rank 0 and starts the other ranks as the one-process server does.

- Greedy replies sent concurrently, a grammar (regex) request among them, carry the same
  tokens as a ``--num-shard 2`` server without the flag and as one shard (logprobs within
  1e-3).  Streams cancelled mid-generation (a constrained one among them) are aborted in the
  engine process: no KV block stays in use, the scheduler's invariants hold, and the ranks
  are still in step (the same replies after it).  Stopping the server leaves no engine
  process and no shard behind.
- A shard worker killed mid-generation: every call ends UNAVAILABLE naming the shard, health
  turns NOT_SERVING, the server exits 1 with ``shard_failure_exit`` naming the shard, and no
  process of the server is left.  The engine process (rank 0) killed: the calls end
  UNAVAILABLE, the server exits non-zero, the worker exits.  The front killed with SIGKILL:
  the engine process and the worker exit.  SIGTERM: exit 0, every process gone.  While
  loading: a shard killed fails the launch (exit 1, the shard named), SIGTERM exits 0; no
  process left either way.

Small on purpose (few prompts, few tokens): a sharded start costs ~10 s of CPU here.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import grpc
import pytest

from genserve.engine.process_engine import ProcessEngine
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import varied_prompts
from tests.e2e.test_tensor_parallel_failures import (
    kill_shard_and_check_reported,
    start_calls,
    watch_health,
)
from tests.e2e.tp_utils import (
    SERVER_ARGS,
    engine_children,
    shard_args,
    shard_workers_of,
    wait_gone,
)
from tests.utils.inproc_server import InProcessServer, inproc_server
from tests.utils.live_server import LiveServer, start_server

MAX_NEW_TOKENS = 12
REGEX = r"(yes|no), [a-z ]{1,40}\."


def _requests() -> list[pb.GenerateRequest]:
    """Five greedy prompts (the last one of ~300 words: chunked prefills) and a regex one."""
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    prompts = [*varied_prompts(4, seed=7), varied_prompts(12, seed=3)[-1]]
    requests = [pb.GenerateRequest(inputs=[prompt], parameters=params) for prompt in prompts]
    constrained = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    constrained.grammar.regex = REGEX
    requests.append(pb.GenerateRequest(inputs=["Answer yes or no:"], parameters=constrained))
    return requests


def _generate_all(address: str) -> list[pb.Details]:
    """Every request of :func:`_requests` in flight at once."""
    requests = _requests()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)

        def call(request: pb.GenerateRequest) -> pb.Details:
            details: pb.Details = stub.Generate(request, timeout=300).results[0].details
            return details

        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(call, requests))


def _assert_same(got: list[pb.Details], want: list[pb.Details]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert [t.id for t in a.tokens] == [t.id for t in b.tokens], i
        assert [t.logprob for t in a.tokens] == pytest.approx(
            [t.logprob for t in b.tokens], abs=1e-3
        )


def _cancel_streams(address: str) -> None:
    """Two streams (one constrained) cancelled after two tokens each."""
    long = pb.GenerateParameters(max_new_tokens=400, ignore_eos=True)
    constrained = pb.GenerateParameters(max_new_tokens=400, ignore_eos=True)
    constrained.grammar.regex = "[a-z ]{1,1000}"  # still open after 400 tokens
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        streams = [
            stub.GenerateStream(pb.GenerateStreamRequest(inputs=prompt, parameters=params))
            for prompt, params in (("cancel me", long), ("and me too", constrained))
        ]
        for stream in streams:
            next(stream)
            next(stream)
        for stream in streams:
            stream.cancel()


def _wait_blocks_free(server: InProcessServer, engine: ProcessEngine) -> Any:
    deadline = time.monotonic() + 20
    while True:
        stats = server.run(engine.query("stats"))
        if (stats.num_used_blocks, stats.num_running) == (0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_replies_match_without_the_flag_and_one_shard(
    tiny_llama: Path, two_shard_server: LiveServer
) -> None:
    with start_server(tiny_llama, *SERVER_ARGS, wait_serving=False) as one:
        with inproc_server(tiny_llama, *SERVER_ARGS, *shard_args(2), "--engine-process") as srv:
            engine = srv.service.engine
            assert isinstance(engine, ProcessEngine)
            (worker,) = shard_workers_of(engine.pid)
            got = _generate_all(srv.address)
            _cancel_streams(srv.address)
            stats = _wait_blocks_free(srv, engine)
            assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
            srv.run(engine.query("check_invariants"))  # raises on a leak
            assert engine.num_in_flight == 0
            again = _generate_all(srv.address)  # the ranks are still in step
            with grpc.insecure_channel(srv.address) as channel:
                info = pb_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest())
            assert info.num_shard == 2
        assert wait_gone([engine.pid, worker], timeout_s=15) == [], "a process outlived stop"
        one.wait_for(want_serving=True, timeout_s=300)
        single = _generate_all(one.address)
    sharded = _generate_all(two_shard_server.address)
    assert max(d.input_length for d in got) > 300  # chunked prefills too
    _assert_same(got, sharded)
    _assert_same(again, sharded)
    _assert_same(got, single)


def _tp_server(
    tiny_llama: Path, *extra: str, wait_serving: bool = True
) -> AbstractContextManager[LiveServer]:
    args = (*SERVER_ARGS, *shard_args(2), "--engine-process", *extra)
    return start_server(tiny_llama, *args, wait_serving=wait_serving)


def _processes(server: LiveServer) -> tuple[int, int]:
    """(the engine process, its shard worker)."""
    (child,) = engine_children(server.proc.pid)
    (worker,) = shard_workers_of(child)
    return child, worker


def test_shard_killed_mid_generation_ends_the_server(tiny_llama: Path) -> None:
    with _tp_server(tiny_llama) as server:
        child, worker = _processes(server)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            health = watch_health(channel)
            calls = start_calls(stub)
            shard = kill_shard_and_check_reported(worker, calls, health)
        assert server.proc.wait(timeout=30) == 1
        failure_lines = [
            line for line in server.logs().splitlines() if "shard_failure_exit" in line
        ]
        assert failure_lines and shard in failure_lines[0], server.logs()[-3000:]
        assert wait_gone([child, worker], timeout_s=10) == []


def test_engine_process_killed_ends_the_server_and_its_shard(tiny_llama: Path) -> None:
    with _tp_server(tiny_llama) as server:
        child, worker = _processes(server)
        with grpc.insecure_channel(server.address) as channel:
            calls = start_calls(pb_grpc.TextGenerationServiceStub(channel))
            os.kill(child, signal.SIGKILL)
            for call in calls:
                assert call.ended.wait(10), "an in-flight call hangs after rank 0 died"
                assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
        assert server.proc.wait(timeout=30) != 0
        assert "engine process exited" in server.logs()
        assert wait_gone([child, worker], timeout_s=10) == []


def test_front_killed_ends_every_process(tiny_llama: Path) -> None:
    with _tp_server(tiny_llama) as server:
        child, worker = _processes(server)
        server.proc.kill()
        server.proc.wait(timeout=10)
        assert wait_gone([child, worker], timeout_s=10) == []


def test_sigterm_stops_every_process(tiny_llama: Path) -> None:
    with _tp_server(tiny_llama, "--shutdown-timeout", "1") as server:
        child, worker = _processes(server)
        with grpc.insecure_channel(server.address) as channel:
            calls = start_calls(pb_grpc.TextGenerationServiceStub(channel))
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=30)
            for call in calls:  # cancelled after the 1 s grace
                assert call.ended.wait(5)
                assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
        assert code == 0, server.logs()[-3000:]
        assert wait_gone([server.proc.pid, child, worker], timeout_s=10) == []
        assert "shard_failed" not in server.logs()


def _loading_processes(server: LiveServer) -> tuple[int, int]:
    """(the engine process, its shard worker) as soon as the worker is started."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        children = engine_children(server.proc.pid)
        workers = shard_workers_of(children[0]) if children else []
        if workers:
            return children[0], workers[0]
        time.sleep(0.05)
    raise AssertionError("no shard worker was started")


def test_shard_killed_while_loading_fails_the_launch(tiny_llama: Path) -> None:
    with _tp_server(tiny_llama, wait_serving=False) as server:
        child, worker = _loading_processes(server)
        os.kill(worker, signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
        # The line the one-process launcher writes, whether the load or the serving ended.
        failure_lines = [
            line for line in server.logs().splitlines() if "shard_failure_exit" in line
        ]
        assert failure_lines, server.logs()[-3000:]
        assert f"shard 1 (pid {worker})" in failure_lines[0]
        assert wait_gone([child, worker], timeout_s=10) == []


def test_sigterm_while_loading_leaves_no_process(tiny_llama: Path) -> None:
    with _tp_server(tiny_llama, wait_serving=False) as server:
        child, worker = _loading_processes(server)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert wait_gone([server.proc.pid, child, worker], timeout_s=10) == []
