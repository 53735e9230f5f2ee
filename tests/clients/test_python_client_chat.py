"""The Python client's chat methods (sync and asyncio) against a real genserve process."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

import pytest

from genserve.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    NotFoundError,
)
from genserve.v1 import generate_pb2 as pb
from tests.utils.live_server import LiveServer

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello."},
]


def test_chat_and_chat_stream(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        reply = client.chat(MESSAGES, max_new_tokens=12, logprobs=True, top_logprobs=2)
        assert isinstance(reply, pb.ChatResponse)
        (choice,) = reply.choices
        assert choice.message.role == "assistant" and choice.message.content
        assert len(choice.logprobs) == reply.usage.completion_tokens == 12
        assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs)
        assert reply.model == client.info().served_model_name
        # pb messages work as well as dicts; the stream adds up to the unary reply.
        pb_messages = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
        chunks = list(client.chat_stream(pb_messages, max_new_tokens=12))
        assert "".join(c.delta for c in chunks) == choice.message.content
        assert chunks[-1].HasField("finish_reason") and chunks[-1].usage.completion_tokens == 12
        two = client.chat(MESSAGES, n=2, max_new_tokens=6, temperature=0.8, seed=9)
        assert [c.index for c in two.choices] == [0, 1]
        assert two.usage.completion_tokens == 12
        # Closing a stream early is fine (the call is cancelled).
        stream = client.chat_stream(MESSAGES, max_new_tokens=200)
        next(iter(stream))
        stream.close()  # type: ignore[attr-defined]


def test_chat_errors_are_typed(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        with pytest.raises(InvalidArgumentError, match="messages"):
            client.chat([])
        with pytest.raises(InvalidArgumentError, match="role"):
            client.chat([{"role": "robot", "content": "x"}])
        with pytest.raises(InvalidArgumentError, match="json_schema"):
            client.chat(MESSAGES, response_format="json_schema")
        with pytest.raises(NotFoundError, match="no-such-model"):
            client.chat(MESSAGES, model="no-such-model")
        with pytest.raises(InvalidArgumentError, match="presence_penalty"):
            list(client.chat_stream(MESSAGES, presence_penalty=5.0))
        with pytest.raises(TypeError, match="unknown chat message field"):
            client.chat([{"role": "user", "content": "x", "color": "red"}])
        with pytest.raises(TypeError, match="sequence of messages"):
            client.chat("hello")  # type: ignore[arg-type]


def test_async_chat(server: LiveServer) -> None:
    async def main() -> tuple[str, str]:
        async with AsyncClient(server.address, timeout=60) as client:
            reply = await client.chat(MESSAGES, max_new_tokens=10, presence_penalty=0.5)
            text = ""
            async with aclosing(
                client.chat_stream(MESSAGES, max_new_tokens=10, presence_penalty=0.5)
            ) as stream:
                async for chunk in stream:
                    text += chunk.delta
            return reply.choices[0].message.content, text

    unary, streamed = asyncio.run(main())
    assert unary == streamed and unary


def test_chat_response_format_json_schema_constrains_every_choice(server: LiveServer) -> None:
    schema = {"type": "string", "enum": ["red", "green", "blue"]}
    fmt = pb.ResponseFormat(type="json_schema", json_schema=json.dumps(schema))
    with Client(server.address, timeout=120) as client:
        reply = client.chat(MESSAGES, response_format=fmt, n=2, seed=3, temperature=1.0,
                            max_new_tokens=16)  # fmt: skip
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert json.loads(choice.message.content) in schema["enum"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            # An enum keeps the random tiny model's call short enough to finish.
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


def test_chat_tools_in_openai_shapes(server: LiveServer) -> None:
    """tools / tool_choice / tool_calls in OpenAI's dict shapes reach the server: a named
    choice is constrained to a call of that function, and the call goes back as a message."""
    with Client(server.address, timeout=60) as client:
        reply = client.chat(
            MESSAGES,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_new_tokens=40,
        )
        (call,) = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
        assistant = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        }
        result = {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}
        follow_up = client.chat(
            [*MESSAGES, assistant, result],
            tools=[WEATHER],
            tool_choice="none",
            parallel_tool_calls=False,
            max_new_tokens=4,
        )
        assert not follow_up.choices[0].message.tool_calls
