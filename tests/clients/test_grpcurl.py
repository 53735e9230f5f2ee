"""The real grpcurl (installed by scripts/tools.sh) against a real genserve, via reflection only:
no proto files are given to it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from genserve.client import Client
from tests.utils.live_server import LiveServer

SERVICE = "genserve.v1.TextGenerationService"


def grpcurl(tools_bin: Path, server: LiveServer, *args: str) -> str:
    proc = subprocess.run(
        [str(tools_bin / "grpcurl"), "-plaintext", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"grpcurl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def json_messages(text: str) -> list[dict[str, Any]]:
    """grpcurl prints one JSON object per response message, one after the other."""
    decoder = json.JSONDecoder()
    messages, pos = [], 0
    while (pos := _skip_space(text, pos)) < len(text):
        msg, pos = decoder.raw_decode(text, pos)
        messages.append(msg)
    return messages


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def test_list_shows_the_service_health_and_reflection(tools_bin: Path, server: LiveServer) -> None:
    services = grpcurl(tools_bin, server, server.address, "list").split()
    assert SERVICE in services
    assert "grpc.health.v1.Health" in services
    assert any(s.startswith("grpc.reflection.") for s in services)
    methods = grpcurl(tools_bin, server, server.address, "list", SERVICE).split()
    assert {f"{SERVICE}.{m}" for m in ("Generate", "GenerateStream", "Health", "Info")} <= set(
        methods
    )


def test_describe(tools_bin: Path, server: LiveServer) -> None:
    service = grpcurl(tools_bin, server, server.address, "describe", SERVICE)
    assert "rpc GenerateStream ( .genserve.v1.GenerateStreamRequest ) returns ( stream" in service
    params = grpcurl(
        tools_bin, server, server.address, "describe", "genserve.v1.GenerateParameters"
    )
    assert "optional uint32 max_new_tokens = 1;" in params


def test_generate_returns_the_text_the_client_gets(tools_bin: Path, server: LiveServer) -> None:
    request = {"inputs": ["The capital of France is"], "parameters": {"max_new_tokens": 6}}
    out = grpcurl(
        tools_bin, server, "-d", json.dumps(request), server.address, f"{SERVICE}/Generate"
    )
    (response,) = json_messages(out)
    with Client(server.address, timeout=60) as client:
        expected = client.generate("The capital of France is", max_new_tokens=6)
    assert len(response["results"]) == 1
    assert response["results"][0].get("generated_text", "") == expected.generated_text


def test_generate_stream_streams(tools_bin: Path, server: LiveServer) -> None:
    request = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 6}}
    out = grpcurl(
        tools_bin, server, "-d", json.dumps(request), server.address, f"{SERVICE}/GenerateStream"
    )
    messages = json_messages(out)
    assert len(messages) >= 1
    last = messages[-1]
    assert int(last["details"]["generated_tokens"]) == len(messages)
    text = "".join(m["token"].get("text", "") for m in messages)
    assert last.get("generated_text", "") == text


def test_health_check_through_grpcurl(tools_bin: Path, server: LiveServer) -> None:
    out = grpcurl(
        tools_bin,
        server,
        "-d",
        json.dumps({"service": SERVICE}),
        server.address,
        "grpc.health.v1.Health/Check",
    )
    assert json_messages(out) == [{"status": "SERVING"}]
