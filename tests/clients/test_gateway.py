"""HTTP/JSON through the real grpc-gateway binary (clients/go/cmd/genserve-gateway) to real
genserve processes: the mapping in deploy/gateway/genserve.yaml, status codes, NDJSON streams."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from genserve.client import Client
from tests.clients.conftest import MAX_CLIENT_BATCH_SIZE, ROOT
from tests.clients.gateway_process import Gateway, run_gateway
from tests.clients.inflight import request_in_flight
from tests.utils.live_server import LiveServer, free_port


@pytest.fixture(scope="module")
def gateway(gateway_bin: Path, server: LiveServer) -> Iterator[Gateway]:
    with run_gateway(gateway_bin, server.address) as gw:
        yield gw


def test_generate(gateway: Gateway, server: LiveServer) -> None:
    body = {
        "inputs": ["Hello there", "1 2 3"],
        "parameters": {"max_new_tokens": 5, "details": True},
    }
    status, reply = gateway.json("POST", "/v1/generate", body)
    assert status == 200, reply
    with Client(server.address, timeout=60) as client:
        expected = client.generate(["Hello there", "1 2 3"], max_new_tokens=5)
    # Proto field names, as in TGI's HTTP API.
    assert [r["generated_text"] for r in reply["results"]] == [e.generated_text for e in expected]
    details = reply["results"][0]["details"]
    assert details["finish_reason"] in ("FINISH_REASON_LENGTH", "FINISH_REASON_EOS_TOKEN")
    assert 1 <= details["generated_tokens"] <= 5
    assert len(details["tokens"]) == details["generated_tokens"]
    # The OpenAPI spec describes exactly this JSON (proto field names).
    definitions = openapi_spec()["definitions"]
    assert set(reply["results"][0]) <= set(definitions["v1GenerateResult"]["properties"])
    assert set(details) <= set(definitions["v1Details"]["properties"])  # seed: only if sampled
    assert "max_new_tokens" in definitions["v1GenerateParameters"]["properties"]


def test_health_info_tokenize(gateway: Gateway) -> None:
    status, reply = gateway.json("GET", "/v1/health")
    assert (status, reply) == (200, {})
    status, info = gateway.json("GET", "/v1/info")
    assert status == 200
    assert info["max_client_batch_size"] == MAX_CLIENT_BATCH_SIZE
    assert info["max_total_tokens"] > info["max_input_tokens"] > 0
    status, reply = gateway.json("POST", "/v1/tokenize", {"inputs": "Hello world"})
    assert status == 200 and reply["tokens"]
    assert all({"id", "text", "start", "stop"} <= set(t) for t in reply["tokens"])
    status, _, _ = gateway.request("GET", "/healthz")
    assert status == 200


def test_generate_stream_is_ndjson(gateway: Gateway, server: LiveServer) -> None:
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}
    status, _, raw = gateway.request("POST", "/v1/generate_stream", body)
    assert status == 200
    lines = raw.decode().splitlines()
    messages = [json.loads(line)["result"] for line in lines if line.strip()]
    assert [m["index"] for m in messages] == list(range(len(messages)))
    last = messages[-1]
    text = "".join(m["token"]["text"] for m in messages)
    assert last["generated_text"] == text
    assert last["details"]["generated_tokens"] == len(messages)
    assert all("generated_text" not in m for m in messages[:-1])
    with Client(server.address, timeout=60) as client:
        assert client.generate("Once upon a time", max_new_tokens=8).generated_text == text


def test_invalid_argument_is_400(gateway: Gateway) -> None:
    too_many = {"inputs": ["a"] * (MAX_CLIENT_BATCH_SIZE + 1), "parameters": {"max_new_tokens": 1}}
    for body in (too_many, {"inputs": ["x"], "parameters": {"top_p": 1.5}}):
        status, reply = gateway.json("POST", "/v1/generate", body)
        assert status == 400, reply
        assert reply["code"] == 3 and reply["message"]  # INVALID_ARGUMENT, with the reason
    bad_stream = {"inputs": "x", "parameters": {"top_p": 1.5}}
    status, _, raw = gateway.request("POST", "/v1/generate_stream", bad_stream)
    assert status == 400, raw
    # Malformed JSON never reaches the server; the gateway itself answers 400.
    status, _, _ = gateway.request("POST", "/v1/generate", "not an object")
    assert status == 400


def test_overload_is_429(gateway_bin: Path, busy_server: LiveServer) -> None:
    with (
        run_gateway(gateway_bin, busy_server.address) as gw,
        request_in_flight(busy_server.address),
    ):
        status, reply = gw.json("POST", "/v1/generate", {"inputs": ["x"]})
        assert status == 429, reply
        assert reply["code"] == 8  # RESOURCE_EXHAUSTED


def test_unavailable_is_503(gateway_bin: Path) -> None:
    with run_gateway(gateway_bin, f"127.0.0.1:{free_port()}") as gw:  # nothing listens there
        for method, path in (("GET", "/v1/health"), ("GET", "/v1/info")):
            status, reply = gw.json(method, path)
            assert status == 503, reply
            assert reply["code"] == 14  # UNAVAILABLE
        status, _, _ = gw.request("POST", "/v1/generate", {"inputs": ["x"]})
        assert status == 503


def openapi_spec() -> Any:
    return json.loads(
        (ROOT / "deploy" / "gateway" / "openapi" / "genserve.swagger.json").read_text()
    )


def test_openapi_spec_lists_every_route() -> None:
    spec = openapi_spec()
    routes = {(path, method) for path, ops in spec["paths"].items() for method in ops}
    assert routes == {
        ("/v1/generate", "post"),
        ("/v1/generate_stream", "post"),
        ("/v1/health", "get"),
        ("/v1/info", "get"),
        ("/v1/tokenize", "post"),
    }
    assert os.path.getsize(ROOT / "deploy" / "gateway" / "genserve.yaml") > 0
