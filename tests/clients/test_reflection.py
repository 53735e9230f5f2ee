"""Server reflection as the gRPC ecosystem's tools use it: grpcurl describes methods, messages
and enums; both grpc.reflection.v1 and v1alpha answer; ghz loads the server by reflection."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from tests.utils.live_server import LiveServer

SERVICE = "genserve.v1.TextGenerationService"


def grpcurl(tools_bin: Path, *args: str) -> str:
    proc = subprocess.run(
        [str(tools_bin / "grpcurl"), "-plaintext", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"grpcurl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


def test_grpcurl_describes_a_method_a_message_and_an_enum(
    tools_bin: Path, server: LiveServer
) -> None:
    method = grpcurl(tools_bin, server.address, "describe", f"{SERVICE}.Generate")
    assert "is a method" in method
    assert "rpc Generate ( .genserve.v1.GenerateRequest ) returns ( .genserve.v1.Generate" in (
        method
    )
    stream = grpcurl(tools_bin, server.address, "describe", f"{SERVICE}.GenerateStream")
    assert "returns ( stream .genserve.v1.GenerateStreamResponse )" in stream
    message = grpcurl(tools_bin, server.address, "describe", "genserve.v1.GenerateRequest")
    assert "is a message" in message and "message GenerateRequest {" in message
    enum = grpcurl(tools_bin, server.address, "describe", "genserve.v1.FinishReason")
    assert "is an enum" in enum and "FINISH_REASON_LENGTH" in enum
    health = grpcurl(tools_bin, server.address, "describe", "grpc.health.v1.Health.Check")
    assert "is a method" in health


def test_grpcurl_lists_both_reflection_versions(tools_bin: Path, server: LiveServer) -> None:
    services = grpcurl(tools_bin, server.address, "list").split()
    assert "grpc.reflection.v1.ServerReflection" in services
    assert "grpc.reflection.v1alpha.ServerReflection" in services
    v1 = grpcurl(tools_bin, server.address, "describe", "grpc.reflection.v1.ServerReflection")
    assert "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest )" in v1


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
@pytest.mark.parametrize(
    "symbol",
    [
        f"{SERVICE}",
        f"{SERVICE}.Generate",
        "genserve.v1.GenerateParameters",
        "genserve.v1.FinishReason",
        "genserve.v1.FinishReason.FINISH_REASON_LENGTH",
    ],
)
def test_both_reflection_versions_resolve_every_symbol_kind(
    server: LiveServer, version: str, symbol: str
) -> None:
    """Raw reflection requests to each version's path (same wire messages): the file that
    defines the symbol comes back; an unknown symbol gets NOT_FOUND, not a broken stream."""
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol + ".Nope"),
        ]
        found, missing = list(call(iter(requests), timeout=30))
    assert found.WhichOneof("message_response") == "file_descriptor_response"
    assert found.file_descriptor_response.file_descriptor_proto
    assert missing.WhichOneof("message_response") == "error_response"
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def ghz(tools_bin: Path, server: LiveServer, method: str, *args: str) -> dict[str, object]:
    """Run ghz by reflection only (no proto files) and return its JSON report."""
    proc = subprocess.run(
        [
            str(tools_bin / "ghz"),
            "--insecure",
            "--call",
            f"{SERVICE}.{method}",
            "--format",
            "json",
            "--timeout",
            "60s",
            *args,
            server.address,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"ghz: {proc.stderr}\n{proc.stdout[-2000:]}"
    report: dict[str, object] = json.loads(proc.stdout)
    return report


GENERATE = json.dumps({"inputs": ["Hello there"], "parameters": {"max_new_tokens": 4}})
STREAM = json.dumps({"inputs": "Hello there", "parameters": {"max_new_tokens": 4}})


@pytest.mark.parametrize(("method", "data"), [("Generate", GENERATE), ("GenerateStream", STREAM)])
def test_ghz_below_the_concurrency_limit_has_no_errors(
    tools_bin: Path, server: LiveServer, method: str, data: str
) -> None:
    # The shared server admits 8 concurrent requests; 4 workers stay below.
    report = ghz(tools_bin, server, method, "-d", data, "-n", "24", "-c", "4")
    assert report["count"] == 24
    assert report.get("errorDistribution") in (None, {}), report.get("errorDistribution")
    assert report["statusCodeDistribution"] == {"OK": 24}


@pytest.mark.parametrize(("method", "data"), [("Generate", GENERATE), ("GenerateStream", STREAM)])
def test_ghz_above_the_concurrency_limit_gets_only_resource_exhausted(
    tools_bin: Path, busy_server: LiveServer, method: str, data: str
) -> None:
    # busy_server admits one request at a time; 6 concurrent workers must be refused, and
    # refused only with RESOURCE_EXHAUSTED.
    report = ghz(tools_bin, busy_server, method, "-d", data, "-n", "30", "-c", "6")
    codes = report["statusCodeDistribution"]
    assert isinstance(codes, dict)
    assert set(codes) <= {"OK", "ResourceExhausted"}, codes
    assert codes.get("OK", 0) >= 1 and codes.get("ResourceExhausted", 0) >= 1, codes
