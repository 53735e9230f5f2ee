"""TGI's HTTP API on genserve-gateway, used by huggingface_hub's InferenceClient unchanged and
checked byte for byte where TGI's format matters (server-sent events), against a real genserve."""

from __future__ import annotations

import json
import time

import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

from genserve.client import Client
from tests.clients.conftest import DialectGateway

PROMPT = "Once upon a time"


def grpc_text(dialects: DialectGateway, prompt: str, max_new_tokens: int) -> str:
    with Client(dialects.server.address, timeout=60) as client:
        return str(client.generate(prompt, max_new_tokens=max_new_tokens).generated_text)


@pytest.mark.parametrize("suffix", ["", "/v1"])
def test_text_generation_details(dialects: DialectGateway, suffix: str) -> None:
    # InferenceClient(base_url) posts text_generation to the base URL itself (TGI's "/").
    hf = InferenceClient(base_url=dialects.gateway.url + suffix)
    out = hf.text_generation(
        PROMPT, max_new_tokens=6, details=True, decoder_input_details=True, top_n_tokens=2
    )
    assert out.generated_text == grpc_text(dialects, PROMPT, 6)
    details = out.details
    assert details is not None
    assert details.finish_reason in ("length", "eos_token")
    assert details.generated_tokens == len(details.tokens) <= 6
    assert "".join(t.text for t in details.tokens) == out.generated_text
    assert all(t.logprob <= 0 and t.special is False for t in details.tokens)
    assert details.prefill and details.prefill[0].logprob is None
    assert [len(top) for top in details.top_tokens or []] == [2] * len(details.tokens)
    assert details.best_of_sequences is None


def test_text_generation_stream_details(dialects: DialectGateway) -> None:
    hf = InferenceClient(base_url=dialects.gateway.url)
    events = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.index for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.token.text for e in events)
    assert events[-1].generated_text == text == grpc_text(dialects, PROMPT, 8)
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1].details
    assert last is not None and last.generated_tokens == len(events)
    assert last.finish_reason in ("length", "eos_token")
    # Without details the client yields the token texts only.
    plain = list(hf.text_generation(PROMPT, max_new_tokens=8, stream=True))
    assert "".join(plain) == text


def test_generate_stream_raw_sse(dialects: DialectGateway) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4, "details": True}}
    status, headers, raw = dialects.gateway.request("POST", "/generate_stream", body)
    assert status == 200
    assert headers["Content-Type"] == "text/event-stream"
    frames = raw.decode().split("\n\n")
    assert frames[-1] == ""  # every event ends with a blank line
    events = [json.loads(f.removeprefix("data:")) for f in frames[:-1]]
    # TGI writes `data:` without a space, and these keys in this order.
    assert all(f.startswith('data:{"index":') for f in frames[:-1])
    assert all(list(e) == ["index", "token", "generated_text", "details"] for e in events)
    assert list(events[0]["token"]) == ["id", "text", "logprob", "special"]
    assert set(events[-1]["details"]) == {
        "finish_reason",
        "generated_tokens",
        "seed",
        "input_length",
    }


def test_generate_and_compat_route(dialects: DialectGateway) -> None:
    gw = dialects.gateway
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}
    status, reply = gw.json("POST", "/generate", body)
    assert (status, list(reply)) == (200, ["generated_text"])  # no details unless asked
    status, listed = gw.json("POST", "/", body)
    assert status == 200 and listed == [reply]  # "/" answers a one-element list, like TGI
    status, _, raw = gw.request("POST", "/", {**body, "stream": True})
    assert status == 200 and raw.startswith(b'data:{"index":1,')


def test_info_health_tokenize(dialects: DialectGateway) -> None:
    gw = dialects.gateway
    status, info = gw.json("GET", "/info")
    assert status == 200
    for key in ("model_id", "max_input_tokens", "max_total_tokens", "max_best_of", "version"):
        assert info[key], key
    assert info["model_pipeline_tag"] == "text-generation"
    status, _, raw = gw.request("GET", "/health")
    assert (status, raw) == (200, b"")
    status, tokens = gw.json("POST", "/tokenize", {"inputs": "Hello world"})
    assert status == 200
    assert [list(t) for t in tokens] == [["id", "text", "start", "stop"]] * len(tokens)
    assert tokens[-1]["stop"] == len("Hello world")


def test_validation_errors(dialects: DialectGateway) -> None:
    gw = dialects.gateway
    for path in ("/generate", "/generate_stream", "/"):
        status, reply = gw.json("POST", path, {"inputs": "x", "parameters": {"top_p": 1.5}})
        assert status == 422, (path, reply)
        assert reply["error_type"] == "validation" and "top_p" in reply["error"]
    status, reply = gw.json("POST", "/generate", {"inputs": "x", "parameters": {"nope": 1}})
    assert status == 422 and "nope" in reply["error"]
    status, reply = gw.json("POST", "/generate", {"parameters": {}})
    assert status == 422 and "inputs" in reply["error"]
    hf = InferenceClient(base_url=dialects.gateway.url)
    with pytest.raises(ValidationError, match="top_p"):
        hf.text_generation("x", top_p=1.5)


def test_request_id_reaches_the_server(dialects: DialectGateway) -> None:
    body = {"inputs": "x", "parameters": {"max_new_tokens": 1}}
    status, _, _ = dialects.gateway.request(
        "POST", "/generate", body, headers={"X-Request-Id": "gateway-req-4242"}
    )
    assert status == 200
    deadline = time.monotonic() + 10
    while "gateway-req-4242" not in dialects.server.logs():
        assert time.monotonic() < deadline, "X-Request-Id not forwarded as gRPC metadata"
        time.sleep(0.05)


def test_grammar_json_and_regex(dialects: DialectGateway) -> None:
    """TGI's `grammar` ({"type": "json" | "regex", "value": ...}) through InferenceClient:
    the gateway maps it onto GenerateParameters.grammar, the output follows it and ends by
    EOS where the grammar completes; a bad regex is the server's INVALID_ARGUMENT (422)."""
    import re

    import jsonschema  # type: ignore[import-untyped]

    hf = InferenceClient(base_url=dialects.gateway.url)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
        "required": ["ok", "size"],
        "additionalProperties": False,
    }
    out = hf.text_generation(
        PROMPT, max_new_tokens=40, details=True, grammar={"type": "json", "value": schema}
    )
    jsonschema.validate(json.loads(out.generated_text), schema)
    assert out.details is not None and out.details.finish_reason == "eos_token"
    out = hf.text_generation(
        PROMPT, max_new_tokens=20, details=True, grammar={"type": "regex", "value": "[0-9]{4}"}
    )
    assert re.fullmatch("[0-9]{4}", out.generated_text), out.generated_text
    assert out.details is not None and out.details.finish_reason == "eos_token"
    streamed = "".join(
        hf.text_generation(
            PROMPT, max_new_tokens=20, stream=True, grammar={"type": "regex", "value": "(yes|no)"}
        )
    )
    assert streamed in ("yes", "no")
    with pytest.raises(ValidationError, match=r"grammar\.regex"):
        hf.text_generation(PROMPT, grammar={"type": "regex", "value": "(unclosed"})
    status, reply = dialects.gateway.json(
        "POST",
        "/generate",
        {"inputs": "x", "parameters": {"grammar": {"type": "ebnf", "value": "x"}}},
    )
    assert status == 422 and "grammar" in reply["error"]
