"""Issue #27: constrained output on a server started with --reasoning-parser, over gRPC and
HTTP (the openai package).  The grammar leaves the reasoning free and applies once it ends.

The tiny model's tokenizer has ``<think>`` and ``</think>`` as tokens of their own (as Qwen3's
and DeepSeek-R1's tokenizers do), so a `logit_bias` on ``</think>`` makes the random model end
its reasoning at once, deterministically; without it the random model never ends it, and the
reasoning it writes is exactly its unconstrained greedy text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from genserve.testing.tiny_model import default_tokenizer_dir, make_tiny_model
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.clients.gateway_process import Gateway, run_gateway
from tests.utils.live_server import LiveServer, start_server

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
MESSAGES: list[Any] = [{"role": "user", "content": "Is the sky blue? Think first."}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny model whose tokenizer has <think> / </think> tokens; and the id of </think>."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok_dir = tmp_path_factory.mktemp("thinking-tokenizer")
    tok.save_pretrained(str(tok_dir))
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-thinking"), tokenizer_dir=tok_dir, seed=3)
    return model, int(tok.convert_tokens_to_ids("</think>"))


@pytest.fixture(scope="module")
def served(
    thinking_model: tuple[Path, int], gateway_bin: Path
) -> Iterator[tuple[LiveServer, Gateway]]:
    with (
        start_server(
            thinking_model[0], "--reasoning-parser", "deepseek_r1", "--prometheus-port", "0"
        ) as srv,
        run_gateway(gateway_bin, srv.address) as gw,
    ):
        yield srv, gw


@pytest.fixture(scope="module")
def client(served: tuple[LiveServer, Gateway]) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key="unused", max_retries=0)


def reasoning_of(message: Any) -> str:
    return str((message.model_extra or {}).get("reasoning_content") or "")


def test_reasoning_is_not_constrained(client: openai.OpenAI) -> None:
    """Until </think> the grammar allows every token: the reasoning under a JSON schema is the
    model's unconstrained greedy text (which is no JSON)."""

    def reply(**extra: Any) -> Any:
        out = client.chat.completions.create(
            model="", messages=MESSAGES, max_tokens=8, temperature=0, **extra
        )
        return out.choices[0]

    free = reply()
    constrained = reply(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    )
    assert free.finish_reason == constrained.finish_reason == "length"
    assert reasoning_of(free.message) and not free.message.content
    assert reasoning_of(constrained.message) == reasoning_of(free.message)
    assert not constrained.message.content


def test_schema_applies_after_the_reasoning_http(
    client: openai.OpenAI, thinking_model: tuple[Path, int]
) -> None:
    bias = {str(thinking_model[1]): 100}
    free = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=12, temperature=0, logit_bias=bias
    )
    free_content = free.choices[0].message.content or ""
    with pytest.raises(ValueError):  # the model's own answer after </think> is no JSON
        json.loads(free_content)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        logit_bias=bias,
        response_format=fmt,
    )
    choice = out.choices[0]
    assert reasoning_of(choice.message) == ""
    jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    assert choice.finish_reason == "stop"
    # Streamed: the same reply in deltas.
    chunks = list(
        client.chat.completions.create(
            model="",
            messages=MESSAGES,
            max_tokens=40,
            temperature=0,
            logit_bias=bias,
            response_format=fmt,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content


def test_required_tool_call_after_the_reasoning(
    client: openai.OpenAI, thinking_model: tuple[Path, int]
) -> None:
    out = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,  # one call: the random model would list calls until cut
        logit_bias={str(thinking_model[1]): 100},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    for call in calls:
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
        jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])


def test_schema_applies_after_the_reasoning_grpc(
    served: tuple[LiveServer, Gateway], thinking_model: tuple[Path, int]
) -> None:
    with grpc.insecure_channel(served[0].address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        out = stub.Chat(
            pb.ChatRequest(
                messages=[pb.ChatMessage(role="user", content=MESSAGES[0]["content"])],
                parameters=pb.GenerateParameters(
                    max_new_tokens=40, logit_bias={thinking_model[1]: 100.0}
                ),
                response_format=pb.ResponseFormat(
                    type="json_schema", json_schema=json.dumps(SCHEMA)
                ),
            ),
            timeout=60,
        )
    message = out.choices[0].message
    assert message.reasoning_content == ""
    jsonschema.validate(json.loads(message.content), SCHEMA)
