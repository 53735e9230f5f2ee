"""What a 2-shard server does when processes die or are told to stop, through real
processes and real signals:

- a worker killed with SIGKILL mid-generation: grpc.health.v1 turns NOT_SERVING within 2 s,
  every in-flight call ends UNAVAILABLE naming the shard (none hangs), and the launcher
  exits non-zero with a log line naming the shard;
- SIGTERM to rank 0: in-flight work is finished or cancelled within --shutdown-timeout,
  the launcher exits 0 and no process of the server is left (also while still loading);
- rank 0 killed with SIGKILL (no chance to clean up): the workers still exit.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.tp_utils import SERVER_ARGS, shard_args, shard_workers, start_servers, wait_gone
from tests.utils.live_server import start_server

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Long enough that no call ends by itself during a test (the tiny model never emits EOS on
# these prompts within the budget, and each step takes milliseconds).
LONG = pb.GenerateParameters(max_new_tokens=1000, ignore_eos=True)


@dataclass
class Call:
    """One in-flight RPC in a thread: how it ended and how many tokens it streamed."""

    num_tokens: int = 0
    started: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    code: grpc.StatusCode | None = None
    details: str = ""


def stream_in_thread(stub: pb_grpc.TextGenerationServiceStub, prompt: str) -> Call:
    call = Call()

    def run() -> None:
        try:
            for _ in stub.GenerateStream(pb.GenerateStreamRequest(inputs=prompt, parameters=LONG)):
                call.num_tokens += 1
                call.started.set()
            call.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            call.code, call.details = exc.code(), exc.details() or ""
        finally:
            call.started.set()
            call.ended.set()

    threading.Thread(target=run, daemon=True).start()
    return call


def unary_in_thread(stub: pb_grpc.TextGenerationServiceStub, prompt: str) -> Call:
    call = Call()
    call.started.set()

    def run() -> None:
        try:
            stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=LONG))
            call.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            call.code, call.details = exc.code(), exc.details() or ""
        finally:
            call.ended.set()

    threading.Thread(target=run, daemon=True).start()
    return call


def watch_health(channel: grpc.Channel) -> list[tuple[float, int]]:
    """grpc.health.v1 Watch in a thread: (monotonic time, status) of every update."""
    updates: list[tuple[float, int]] = []
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

    def run() -> None:
        try:
            for reply in stream:
                updates.append((time.monotonic(), int(reply.status)))
        except grpc.RpcError:
            pass  # the server went away

    threading.Thread(target=run, daemon=True).start()
    return updates


def start_calls(stub: pb_grpc.TextGenerationServiceStub) -> list[Call]:
    """Three streams and one unary call, all generating when this returns."""
    calls = [stream_in_thread(stub, p) for p in ("the quick brown fox", "servers stream", "东京")]
    calls.append(unary_in_thread(stub, "café résumé"))
    for call in calls:
        assert call.started.wait(60), "a stream produced no token"
    time.sleep(0.2)  # the unary call is admitted and generating too
    assert not any(c.ended.is_set() for c in calls), [(c.code, c.details) for c in calls]
    return calls


def kill_shard_and_check_reported(
    worker: int, calls: list[Call], health: list[tuple[float, int]]
) -> str:
    """SIGKILL shard 1's ``worker`` while ``calls`` stream; check every call ends UNAVAILABLE
    naming the shard and health turns NOT_SERVING within 2 s.  Returns the shard's name."""
    killed_at = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    for call in calls:
        assert call.ended.wait(10), "an in-flight call hangs after the shard died"
    shard = f"shard 1 (pid {worker})"
    for call in calls:
        assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
        assert shard in call.details
    # The Watch update travels on its own stream, so it may land just after the calls
    # failed: wait for it up to the 2 s the server has to report the death.
    deadline = killed_at + 2.0
    not_serving = [t for t, status in health if status == NOT_SERVING]
    while not not_serving and time.monotonic() < deadline:
        time.sleep(0.02)
        not_serving = [t for t, status in health if status == NOT_SERVING]
    assert not_serving, f"health never turned NOT_SERVING: {health}"
    assert not_serving[0] - killed_at < 2.0
    return shard


def test_worker_killed_mid_generation(tiny_llama: Path) -> None:
    with start_servers([(tiny_llama, SERVER_ARGS + shard_args(2))]) as (server,):
        (worker,) = shard_workers(server)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            health = watch_health(channel)
            calls = start_calls(stub)
            shard = kill_shard_and_check_reported(worker, calls, health)
            # While it lingers, new calls are refused with the reason.
            try:
                stub.Health(pb.HealthRequest(), timeout=2)
                raise AssertionError("Health answered OK after a shard died")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE

        code = server.proc.wait(timeout=30)
        assert code != 0
        failure_lines = [
            line for line in server.logs().splitlines() if "shard_failure_exit" in line
        ]
        assert failure_lines and shard in failure_lines[0], server.logs()[-3000:]


def test_sigterm_stops_every_rank(tiny_llama: Path) -> None:
    with start_servers(
        [(tiny_llama, SERVER_ARGS + shard_args(2) + ("--shutdown-timeout", "1"))]
    ) as (server,):
        pids = [server.proc.pid, *shard_workers(server)]
        assert len(pids) == 2
        with grpc.insecure_channel(server.address) as channel:
            calls = start_calls(pb_grpc.TextGenerationServiceStub(channel))
            stopped_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(timeout=30)
            elapsed = time.monotonic() - stopped_at
            for call in calls:  # cancelled after the 1 s grace: nothing runs for 1000 tokens
                assert call.ended.wait(5)
                assert call.code == grpc.StatusCode.UNAVAILABLE, (call.code, call.details)
        assert code == 0, server.logs()[-3000:]
        assert elapsed < 15
        assert wait_gone(pids, timeout_s=5) == []
        assert "shard_failed" not in server.logs()


def test_workers_exit_when_rank0_is_killed(tiny_llama: Path) -> None:
    with start_servers([(tiny_llama, SERVER_ARGS + shard_args(2))]) as (server,):
        workers = shard_workers(server)
        assert len(workers) == 1
        server.proc.kill()
        server.proc.wait(timeout=10)
        assert wait_gone(workers, timeout_s=10) == []


def test_sigterm_while_loading_leaves_no_process(tiny_llama: Path) -> None:
    args = SERVER_ARGS + shard_args(2)
    with start_server(tiny_llama, *args, wait_serving=False) as server:
        deadline = time.monotonic() + 60
        while not (workers := shard_workers(server)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert workers, "no shard worker was started"
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0
        assert wait_gone([server.proc.pid, *workers], timeout_s=10) == []
