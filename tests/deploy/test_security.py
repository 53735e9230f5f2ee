"""--api-key, TLS, mutual TLS and transport limits against a real genserve process, with
throw-away certificates made by the ``cryptography`` package."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from genserve.client import Client, GenserveError, tls_credentials
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.certs import Authority
from tests.utils.live_server import LiveServer, free_port, start_server

API_KEY = "s3cret-key-7f1c2b"  # a distinctive string: the log check looks for it


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = Authority("genserve test CA"), Authority("someone else's CA")
    (directory / "ca.crt").write_bytes(ca.cert_pem)
    (directory / "rogue-ca.crt").write_bytes(rogue.cert_pem)
    server_cert, server_key = ca.issue("localhost", server=True).write(directory, "server")
    client_cert, client_key = ca.issue("client", server=False).write(directory, "client")
    rogue_cert, rogue_key = rogue.issue("client", server=False).write(directory, "rogue")
    return Pki(
        directory / "ca.crt",
        server_cert,
        server_key,
        client_cert,
        client_key,
        directory / "rogue-ca.crt",
        rogue_cert,
        rogue_key,
    )


@pytest.fixture(scope="module")
def tls_server(tiny_model: Path, pki: Pki) -> Iterator[LiveServer]:
    """TLS (no client certificate), an API key from the environment, a 4000-byte message
    limit under TGI's flag name, idle connections closed after 1 s; logs everything (-e,
    --log-requests, JSON) so the key-never-logged check has something to look through."""
    args = (
        "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key),
        "--payload-limit", "4000",
        "--max-connection-idle", "1",
        "--prometheus-port", "0",
        "-e", "--json-output", "--log-requests",
    )  # fmt: skip
    with start_server(
        tiny_model, *args, env={"API_KEY": API_KEY}, credentials=tls_credentials(pki.ca)
    ) as server:
        yield server


@pytest.fixture(scope="module")
def mtls_server(tiny_model: Path, pki: Pki) -> Iterator[LiveServer]:
    args = (
        "--tls-cert-file", str(pki.server_cert),
        "--tls-key-file", str(pki.server_key),
        "--tls-client-ca-file", str(pki.ca),
        "--prometheus-port", "0",
    )  # fmt: skip
    good = tls_credentials(pki.ca, pki.client_cert, pki.client_key)
    with start_server(tiny_model, *args, credentials=good) as server:
        yield server


def _info(
    address: str, credentials: grpc.ChannelCredentials | None, **kw: object
) -> pb.InfoResponse:
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        reply: pb.InfoResponse = stub.Info(pb.InfoRequest(), timeout=10, **kw)
        return reply


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    code: grpc.StatusCode = info.value.code()
    return code


KEY = (("authorization", f"Bearer {API_KEY}"),)


def test_tls_good_client_is_served(tls_server: LiveServer, pki: Pki) -> None:
    with Client(tls_server.address, credentials=tls_credentials(pki.ca), api_key=API_KEY) as c:
        out = c.generate("Hello", max_new_tokens=3)
    assert out.generated_text


def test_tls_plaintext_client_is_refused(tls_server: LiveServer) -> None:
    assert _code(lambda: _info(tls_server.address, None, metadata=KEY)) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_tls_client_trusting_another_ca_is_refused(tls_server: LiveServer, pki: Pki) -> None:
    wrong = tls_credentials(pki.rogue_ca)
    assert _code(lambda: _info(tls_server.address, wrong, metadata=KEY)) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_api_key_right_wrong_missing(tls_server: LiveServer, pki: Pki) -> None:
    creds = tls_credentials(pki.ca)
    assert _info(tls_server.address, creds, metadata=KEY).max_concurrent_requests > 0
    wrong = (("authorization", "Bearer not-the-key"),)
    assert _code(lambda: _info(tls_server.address, creds, metadata=wrong)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    assert _code(lambda: _info(tls_server.address, creds)) == grpc.StatusCode.UNAUTHENTICATED
    basic = (("authorization", f"Basic {API_KEY}"),)
    assert _code(lambda: _info(tls_server.address, creds, metadata=basic)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    # Streaming calls are guarded too, and the Python client raises a typed error.
    client = Client(tls_server.address, credentials=creds, api_key="wrong")
    with client, pytest.raises(GenserveError) as info:
        list(client.generate_stream("Hello", max_new_tokens=2))
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_need_no_key(tls_server: LiveServer, pki: Pki) -> None:
    with grpc.secure_channel(tls_server.address, tls_credentials(pki.ca)) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    names = {s.name for s in reply.list_services_response.service}
    assert "genserve.v1.TextGenerationService" in names


def test_payload_limit_gives_resource_exhausted(tls_server: LiveServer, pki: Pki) -> None:
    creds = tls_credentials(pki.ca)
    with grpc.secure_channel(tls_server.address, creds) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        big = pb.GenerateRequest(inputs=["x" * 10_000])
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(big, timeout=30, metadata=KEY)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_idle_connections_are_closed(tls_server: LiveServer, pki: Pki) -> None:
    """--max-connection-idle 1: a connection without calls gets GOAWAY and the channel falls
    back to IDLE, so idle clients cannot pile up connections."""
    with grpc.secure_channel(tls_server.address, tls_credentials(pki.ca)) as channel:
        pb_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest(), timeout=10, metadata=KEY)
        assert channel._channel.check_connectivity_state(False) == 2  # type: ignore[attr-defined]  # READY
        deadline = time.monotonic() + 10
        state = 2
        while time.monotonic() < deadline:
            state = channel._channel.check_connectivity_state(False)  # type: ignore[attr-defined]
            if state != 2:
                break
            time.sleep(0.1)
    assert state == 0, f"connection still READY after 10 s idle (state {state})"  # IDLE


def test_api_key_is_never_logged(tls_server: LiveServer, pki: Pki) -> None:
    test_api_key_right_wrong_missing(tls_server, pki)
    logs = tls_server.logs()
    assert '"api_key": true' in logs  # the listening line says a key is required ...
    assert API_KEY not in logs  # ... and never which


def test_mtls_good_client_is_served(mtls_server: LiveServer, pki: Pki) -> None:
    good = tls_credentials(pki.ca, pki.client_cert, pki.client_key)
    assert _info(mtls_server.address, good).max_concurrent_requests > 0


def test_mtls_client_without_certificate_is_refused(mtls_server: LiveServer, pki: Pki) -> None:
    assert _code(lambda: _info(mtls_server.address, tls_credentials(pki.ca))) == (
        grpc.StatusCode.UNAVAILABLE
    )


def test_mtls_client_certificate_from_another_ca_is_refused(
    mtls_server: LiveServer, pki: Pki
) -> None:
    rogue = tls_credentials(pki.ca, pki.rogue_client_cert, pki.rogue_client_key)
    assert _code(lambda: _info(mtls_server.address, rogue)) == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def gateway_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gateway") / "genserve-gateway"
    subprocess.run(
        ["go", "build", "-o", str(out), "./cmd/genserve-gateway"],
        cwd=Path(__file__).resolve().parents[2] / "clients" / "go",
        check=True,
        timeout=600,
    )
    return out


def _gateway_status(gateway_bin: Path, server: LiveServer, *flags: str) -> int:
    """HTTP status of GET /v1/info through a gateway started with ``flags``."""
    port = free_port()
    proc = subprocess.Popen(
        [str(gateway_bin), "--grpc-endpoint", server.address, "--listen", f"127.0.0.1:{port}",
         *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/info", timeout=30) as r:
                    return int(r.status)
            except urllib.error.HTTPError as exc:
                return int(exc.code)
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, "gateway not up"
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)


def test_gateway_speaks_mutual_tls_to_genserve(
    gateway_bin: Path, mtls_server: LiveServer, pki: Pki
) -> None:
    good = (
        "--grpc-tls-ca", str(pki.ca),
        "--grpc-tls-cert", str(pki.client_cert),
        "--grpc-tls-key", str(pki.client_key),
        "--grpc-tls-server-name", "localhost",
    )  # fmt: skip
    assert _gateway_status(gateway_bin, mtls_server, *good) == 200
    # Without its certificate, or plaintext, the gateway gets no answer: 503.
    no_cert = ("--grpc-tls-ca", str(pki.ca))
    assert _gateway_status(gateway_bin, mtls_server, *no_cert) == 503
    assert _gateway_status(gateway_bin, mtls_server) == 503
