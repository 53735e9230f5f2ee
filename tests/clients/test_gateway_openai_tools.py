"""Issue #27 on genserve-gateway with the real client libraries: tool calling with the
`openai` package (named, required, parallel, auto, streamed, tool results back through the
template) and huggingface_hub's `chat_completion(tools=...)`, and one test per OpenAI / TGI
divergence that was fixed.

The tiny random-weight model cannot decide to call a tool, so the round trips use the
constrained choices (named / required), whose arguments a grammar makes valid; `auto`
parsing of real model outputs is covered by tests/unit/test_tool_call_parsers.py."""

from __future__ import annotations

import json
from typing import Any

import grpc
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.clients.conftest import DialectGateway

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER_SCHEMA,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time.", "parameters": TIME_SCHEMA},
    },
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the weather in Paris?"}
]


@pytest.fixture(scope="module")
def client(dialects: DialectGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=dialects.gateway.url + "/v1", api_key="unused", max_retries=0)


def check_call(name: str, arguments: str) -> None:
    """The call names a given tool and its arguments validate against that tool's schema."""
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_tool_choice_and_tool_result_round_trip(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's answer for a named choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    assert reply.system_fingerprint
    # The call and its result go back through the chat template.
    follow_up = client.chat.completions.create(
        model="",
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": call.function.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
        ],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The same tool prompt plus the call and its result: a longer prompt.
    assert follow_up.usage is not None and reply.usage is not None
    assert follow_up.usage.prompt_tokens > reply.usage.prompt_tokens


def test_required_single_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    check_call(call.function.name, call.function.arguments)


def test_required_parallel_calls(client: openai.OpenAI) -> None:
    """With parallel calls allowed the grammar admits a list of calls; each validates, or,
    when max_tokens cuts the list, the text comes back as content with "length"."""
    reply = client.chat.completions.create(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "length":
        assert choice.message.tool_calls is None and choice.message.content
        json_prefix = choice.message.content
        assert json_prefix.startswith('[{"name": "get_')
        return
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert calls and len({c.id for c in calls}) == len(calls)
    for call in calls:
        check_call(call.function.name, call.function.arguments)


def test_streamed_tool_calls_equal_unary(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    unary = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        assert chunk.system_fingerprint
        for c in chunk.choices:
            assert not c.delta.content  # the call's JSON is never streamed as text
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": "", "id": ""})
                entry["id"] += d.id or ""
                entry["name"] += (d.function.name if d.function else None) or ""
                entry["arguments"] += (d.function.arguments if d.function else None) or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    expected = unary.choices[0].message.tool_calls or []
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in expected
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_reply_matches_grpc_chat(client: openai.OpenAI, dialects: DialectGateway) -> None:
    """tool_choice auto (the default with tools): the reply is parsed with the server's
    parser; this model answers in text, which comes back as content, as gRPC Chat has it."""
    reply = client.chat.completions.create(
        model="", messages=MESSAGES, tools=TOOLS, max_tokens=12, temperature=0
    )
    with grpc.insecure_channel(dialects.server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest(), timeout=60)
        assert info.tool_call_parser == "hermes"  # the template knows no tools
        rpc = stub.Chat(
            pb.ChatRequest(
                messages=[pb.ChatMessage(role="user", content="What is the weather in Paris?")],
                parameters=pb.GenerateParameters(max_new_tokens=12),
                tools=[
                    pb.Tool(
                        type="function",
                        function=pb.FunctionDefinition(
                            name=t["function"]["name"],
                            description=t["function"].get("description", ""),
                            parameters=json.dumps(t["function"].get("parameters")),
                        ),
                    )
                    for t in TOOLS
                ],
            ),
            timeout=60,
        )
    message = reply.choices[0].message
    assert (message.content or "") == rpc.choices[0].message.content
    assert len(message.tool_calls or []) == len(rpc.choices[0].message.tool_calls)


def test_tool_errors_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="not in `tools`"):
        client.chat.completions.create(
            model="",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(
            model="",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )


def test_huggingface_hub_chat_completion_tools(dialects: DialectGateway) -> None:
    hf = InferenceClient(base_url=dialects.gateway.url)
    out = hf.chat_completion(
        [dict(m) for m in MESSAGES],
        tools=[dict(t) for t in TOOLS],  # type: ignore[misc]
        tool_choice={"function": {"name": "get_time"}},  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    (call,) = out.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"
    args = call.function.arguments
    check_call("get_time", args if isinstance(args, str) else json.dumps(args))
    streamed = list(
        hf.chat_completion(
            [dict(m) for m in MESSAGES],
            tools=[dict(t) for t in TOOLS],  # type: ignore[misc]
            tool_choice="required",
            max_tokens=80,
            temperature=0,
            stream=True,
        )
    )
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in streamed if c.choices][-1]
    if finish == "tool_calls":
        assert deltas
        for d in deltas:
            check_call(d.function.name or "", d.function.arguments)


def test_tgi_tool_prompt_is_refused_not_ignored(dialects: DialectGateway) -> None:
    """TGI's `tool_prompt` would change the prompt; the server renders tools through the
    template instead, so the field is refused rather than dropped."""
    from huggingface_hub.errors import HfHubHTTPError

    hf = InferenceClient(base_url=dialects.gateway.url)
    with pytest.raises(HfHubHTTPError, match="tool_prompt"):
        hf.chat_completion(
            [dict(m) for m in MESSAGES],
            tools=[dict(t) for t in TOOLS],  # type: ignore[misc]
            tool_prompt="Answer with a call of one of these functions:",
            max_tokens=8,
        )


def test_fields_are_served_accepted_unused_or_refused(client: openai.OpenAI) -> None:
    """Bookkeeping fields leave the reply unchanged and are accepted; a field that would
    change the reply and is not served is a 400 naming it."""
    plain = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4, temperature=0)
    kept = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=4, temperature=0,
        user="u-1", metadata={"team": "a"}, store=False, service_tier="auto",
    )  # fmt: skip
    assert kept.choices[0].message.content == plain.choices[0].message.content
    refused: list[dict[str, Any]] = [
        {"reasoning_effort": "high"},
        {"store": True},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
        {"functions": [{"name": "f", "parameters": {"type": "object"}}]},
    ]
    for extra in refused:
        name = next(iter(extra.get("extra_body", extra)))
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(
                model="", messages=MESSAGES, max_tokens=4, temperature=0, **extra
            )
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model="", prompt="Hi", max_tokens=2, extra_body={"frobnicate": 1})
