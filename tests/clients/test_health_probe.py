"""The real grpc_health_probe (installed by scripts/tools.sh) against real genserve processes:
exit 0 while serving, non-zero while the model loads and once shutdown has begun."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from genserve.client import Client, GenserveError
from tests.clients.conftest import SERVER_ARGS
from tests.utils.live_server import LiveServer, start_server

SERVICE = "genserve.v1.TextGenerationService"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING
# grpc_health_probe's documented exit codes.
EXIT_CONNECTION_FAILURE = 2
EXIT_RPC_FAILURE = 3  # the call itself failed: the server closed while answering
EXIT_UNHEALTHY = 4


def probe(tools_bin: Path, address: str, service: str = "") -> int:
    args = [str(tools_bin / "grpc_health_probe"), f"-addr={address}", "-connect-timeout=2s"]
    if service:
        args.append(f"-service={service}")
    return subprocess.run(args, capture_output=True, timeout=30).returncode


def test_serving_exits_zero(tools_bin: Path, server: LiveServer) -> None:
    assert probe(tools_bin, server.address) == 0
    assert probe(tools_bin, server.address, SERVICE) == 0
    assert probe(tools_bin, server.address, "no.such.Service") != 0


def test_not_serving_while_loading(tools_bin: Path, tiny_model: Path) -> None:
    # The port opens (health NOT_SERVING) before torch is even imported, so there are seconds
    # between "the port answers" and "the model is warmed up".
    with start_server(tiny_model, *SERVER_ARGS, wait_serving=False) as server:
        before = server.health_status()
        codes = (probe(tools_bin, server.address), probe(tools_bin, server.address, SERVICE))
        after = server.health_status()
        assert before == NOT_SERVING
        assert after == NOT_SERVING, "the model finished loading before the probes ran"
        assert codes == (EXIT_UNHEALTHY, EXIT_UNHEALTHY)
        server.wait_for(want_serving=True)
        assert probe(tools_bin, server.address) == 0


def test_not_serving_once_shutdown_begins(tools_bin: Path, tiny_model: Path) -> None:
    # A long request in flight keeps the server draining (port open, health NOT_SERVING) after
    # SIGTERM, for up to --shutdown-timeout seconds; then it is aborted and the server exits.
    with start_server(tiny_model, *SERVER_ARGS, "--shutdown-timeout", "3") as server:
        assert probe(tools_bin, server.address) == 0
        streaming = threading.Event()

        def long_request() -> None:
            with Client(server.address, timeout=120) as client:
                try:
                    for _ in client.generate_stream("a long story", max_new_tokens=3000):
                        streaming.set()
                except GenserveError:
                    pass  # aborted by the shutdown: fine, it only had to keep the drain going

        worker = threading.Thread(target=long_request)
        worker.start()
        assert streaming.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        # Shutdown has begun once the server handled the signal: health stops saying SERVING.
        deadline = time.monotonic() + 30
        while server.health_status(timeout_s=1.0) == SERVING:
            assert time.monotonic() < deadline, "health still SERVING 30 s after SIGTERM"
            time.sleep(0.02)
        codes = []
        while server.proc.poll() is None and time.monotonic() < deadline:
            status = server.health_status(timeout_s=1.0)
            rc = probe(tools_bin, server.address)
            codes.append(rc)
            assert rc != 0, "the probe said healthy after shutdown began"
            if status == NOT_SERVING:
                # Draining: the port still answers, and says NOT_SERVING, or it closed
                # between the health read and the probe (refused, or cut mid-call).
                assert rc in (EXIT_UNHEALTHY, EXIT_CONNECTION_FAILURE, EXIT_RPC_FAILURE)
        worker.join(120)
        server.proc.wait(60)
        assert probe(tools_bin, server.address) == EXIT_CONNECTION_FAILURE
        assert EXIT_UNHEALTHY in codes, f"no probe saw the drain (NOT_SERVING): {codes}"
