"""Fixtures for the client tests: tiny real models, real genserve processes, the pinned tools
(grpcurl, grpc_health_probe, buf, ...) from scripts/tools.sh."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.clients.gateway_process import Gateway, build_gateway, run_gateway
from tests.conftest import TinyModelFactory
from tests.utils.live_server import LiveServer, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]

# Shared limits, so the Go and Java suites and these tests can rely on them.
MAX_CLIENT_BATCH_SIZE = 3
SERVER_ARGS = (
    "--max-client-batch-size",
    str(MAX_CLIENT_BATCH_SIZE),
    "--max-concurrent-requests",
    "8",
    "--prometheus-port",
    "0",
)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: TinyModelFactory) -> Path:
    """The tiny Llama (seed 1) the e2e tests serve too: built once per session."""
    return tiny_model_factory("llama", seed=1)


@pytest.fixture(scope="session")
def tools_bin() -> Path:
    """.tools/bin with grpcurl, grpc_health_probe, buf and the protoc plugins (idempotent)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "tools.sh")], check=True)
    return ROOT / ".tools" / "bin"


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[LiveServer]:
    """One serving genserve for the read-mostly tests of every client."""
    with start_server(tiny_model, *SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="session")
def busy_server(tiny_model: Path) -> Iterator[LiveServer]:
    """A genserve that admits one request at a time, to provoke RESOURCE_EXHAUSTED."""
    with start_server(
        tiny_model, "--max-concurrent-requests", "1", "--prometheus-port", "0"
    ) as srv:
        yield srv


@pytest.fixture(scope="session")
def gateway_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The genserve-gateway binary, built once per session."""
    return build_gateway(tmp_path_factory.mktemp("gateway") / "genserve-gateway")


ALLOWED_ORIGIN = "http://app.example"


@dataclass
class DialectGateway:
    """A genserve with metrics on ``metrics_url`` behind a gateway that allows one CORS origin."""

    server: LiveServer
    gateway: Gateway
    metrics_url: str


@pytest.fixture(scope="session")
def dialects(tiny_model: Path, gateway_bin: Path) -> Iterator[DialectGateway]:
    """genserve + genserve-gateway for the OpenAI and TGI dialect tests."""
    metrics_port = free_port()
    args = (*SERVER_ARGS[:-1], str(metrics_port))  # SERVER_ARGS ends with the metrics port
    with (
        start_server(tiny_model, *args) as srv,
        run_gateway(gateway_bin, srv.address, "--cors-allow-origin", ALLOWED_ORIGIN) as gw,
    ):
        yield DialectGateway(srv, gw, f"http://127.0.0.1:{metrics_port}/metrics")


@pytest.fixture(scope="session")
def float32_gateway(tiny_model: Path, gateway_bin: Path) -> Iterator[Gateway]:
    """A float32 genserve (transformers' reference dtype) named ``tiny`` behind a gateway,
    for lm-eval and the OpenAI divergence tests; the client batch limit stays 3, so a batch
    of 8 prompts (lm-eval's) must be fanned out."""
    from genserve.client import Client

    with (
        start_server(
            tiny_model, *SERVER_ARGS, "--dtype", "float32", "--served-model-name", "tiny"
        ) as srv,
        run_gateway(gateway_bin, srv.address) as gw,
    ):
        with Client(srv.address, timeout=60) as c:
            assert c.info().max_client_batch_size == MAX_CLIENT_BATCH_SIZE
        yield gw
