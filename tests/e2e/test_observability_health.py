"""grpc.health.v1 tells the truth over a real server process's life: NOT_SERVING while the
model loads, SERVING when ready, NOT_SERVING as soon as SIGTERM arrives (while in-flight
requests drain), and the genserve ``Health`` RPC agrees at every stage."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.live_server import start_server

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
SERVICE = "genserve.v1.TextGenerationService"
# Greedy decoding of this prompt with the tiny seed-1 model runs for hundreds of tokens
# (no early EOS): a request that is still generating when SIGTERM arrives.
LONG_PROMPT = "Hello world, how are you?"
NUM_DRAIN_TOKENS = 300


class Watcher:
    """grpc.health.v1 Watch for ``service`` in a thread: every status with its time."""

    def __init__(self, channel: grpc.Channel, service: str) -> None:
        self.seen: list[tuple[float, int]] = []
        self._call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service)
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for reply in self._call:
                self.seen.append((time.monotonic(), int(reply.status)))
        except grpc.RpcError:
            pass  # the server went away: the stream ends

    def statuses(self) -> list[int]:
        """Distinct consecutive statuses."""
        out: list[int] = []
        for _, status in self.seen:
            if not out or out[-1] != status:
                out.append(status)
        return out

    def wait_for(self, status: int, timeout_s: float, after: float = 0.0) -> float:
        """When ``status`` was first reported at or after monotonic time ``after``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for when, seen in self.seen:
                if seen == status and when >= after:
                    return when
            time.sleep(0.02)
        raise AssertionError(f"health never became {status}; saw {self.statuses()}")


def _health_rpc_code(stub: pb_grpc.TextGenerationServiceStub) -> grpc.StatusCode:
    try:
        stub.Health(pb.HealthRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_health_transitions_over_the_server_life(tiny_llama: Path) -> None:
    with (
        start_server(
            tiny_llama,
            "--prometheus-port",
            "0",
            "--max-batch-total-tokens",
            "32768",
            wait_serving=False,
        ) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        checker = health_pb2_grpc.HealthStub(channel)
        watchers = {name: Watcher(channel, name) for name in ("", SERVICE)}

        # Loading: the port answers, health says NOT_SERVING, the Health RPC agrees.
        first = checker.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        assert first == NOT_SERVING, "the model was loaded before the first probe"
        assert _health_rpc_code(stub) == grpc.StatusCode.UNAVAILABLE
        try:
            stub.Generate(pb.GenerateRequest(inputs=["hi"]), timeout=5)
            raise AssertionError("Generate succeeded while loading")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE

        # Ready.
        for watcher in watchers.values():
            watcher.wait_for(SERVING, timeout_s=300)
        assert _health_rpc_code(stub) == grpc.StatusCode.OK

        # A long request is generating when SIGTERM arrives.
        stream = stub.GenerateStream(
            pb.GenerateStreamRequest(
                inputs=LONG_PROMPT,
                parameters=pb.GenerateParameters(max_new_tokens=NUM_DRAIN_TOKENS),
            )
        )
        received = [next(stream)]
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for watcher in watchers.values():
            assert watcher.wait_for(NOT_SERVING, 10, after=sigterm_at) - sigterm_at < 5
        # Draining: health says NOT_SERVING, the Health RPC and new calls say UNAVAILABLE,
        # while the in-flight stream is still being served.
        status = checker.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status
        assert status == NOT_SERVING
        assert _health_rpc_code(stub) == grpc.StatusCode.UNAVAILABLE
        try:
            stub.Generate(pb.GenerateRequest(inputs=["hi"]), timeout=5)
            raise AssertionError("Generate accepted during shutdown")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
        received.extend(stream)
        assert received[-1].details.generated_tokens == NUM_DRAIN_TOKENS, "drain cut short"
        assert len(received) == NUM_DRAIN_TOKENS

        assert server.proc.wait(60) == 0
        for name, watcher in watchers.items():
            assert watcher.statuses() == [NOT_SERVING, SERVING, NOT_SERVING], name
