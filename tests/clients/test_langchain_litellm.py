"""Issue #27: LangChain (`langchain-openai`'s ChatOpenAI) and litellm (its OpenAI-compatible
provider), unchanged, against genserve-gateway: structured output through function calling,
bound tools, and litellm's tool calls.

The tiny random model cannot choose to call a tool, so the calls come from the constrained
choices (a named function, `required`), whose arguments the grammar makes valid."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.clients.conftest import DialectGateway

langchain_openai = pytest.importorskip("langchain_openai", reason="in the dev extra")


class Weather(BaseModel):
    """The weather report the user asked for."""

    city: Literal["Paris", "Rome", "Oslo"]
    unit: Literal["celsius", "fahrenheit"]


TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
GET_TIME: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time.", "parameters": TIME_SCHEMA},
}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def model_name(dialects: DialectGateway) -> str:
    client = openai.OpenAI(base_url=dialects.gateway.url + "/v1", api_key="unused")
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def chat(dialects: DialectGateway, model_name: str) -> Any:
    return langchain_openai.ChatOpenAI(
        base_url=dialects.gateway.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=model_name,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )


def test_with_structured_output_function_calling(chat: Any) -> None:
    structured = chat.with_structured_output(Weather, method="function_calling")
    out = structured.invoke(QUESTION)
    assert isinstance(out, Weather)
    raw = chat.with_structured_output(Weather, method="function_calling", include_raw=True)
    result = raw.invoke(QUESTION)
    assert result["parsing_error"] is None
    assert result["parsed"] == out  # greedy: the same call twice
    (call,) = result["raw"].tool_calls
    assert call["name"] == "Weather"
    Weather.model_validate(call["args"])


def test_bind_tools_required(chat: Any) -> None:
    bound = chat.bind_tools([Weather, GET_TIME], tool_choice="required")
    message = bound.invoke(QUESTION)
    assert message.tool_calls
    assert message.response_metadata["finish_reason"] == "tool_calls"
    for call in message.tool_calls:
        assert call["name"] in ("Weather", "get_time")
        if call["name"] == "Weather":
            Weather.model_validate(call["args"])
        else:
            jsonschema.validate(call["args"], TIME_SCHEMA)
    # The call's result goes back through the template, as an agent loop sends it.
    from langchain_core.messages import HumanMessage, ToolMessage

    follow_up = chat.bind_tools([Weather, GET_TIME]).invoke(
        [
            HumanMessage(QUESTION),
            message,
            *[ToolMessage('{"temperature": 21}', tool_call_id=c["id"]) for c in message.tool_calls],
        ]
    )
    assert isinstance(follow_up.content, str)


def test_bind_tools_streamed_equals_unary(chat: Any) -> None:
    bound = chat.bind_tools([GET_TIME], tool_choice="get_time")
    unary = bound.invoke(QUESTION)
    chunks = list(bound.stream(QUESTION))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert [c["args"] for c in merged.tool_calls] == [c["args"] for c in unary.tool_calls]
    assert [c["name"] for c in merged.tool_calls] == ["get_time"]


@pytest.fixture(scope="module")
def litellm_module() -> Iterator[Any]:
    # litellm fetches a model price list from the internet at import unless told to use its
    # bundled copy; the tests have no network.
    saved = os.environ.get("LITELLM_LOCAL_MODEL_COST_MAP")
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    litellm = pytest.importorskip("litellm", reason="in the dev extra")
    litellm.telemetry = False
    yield litellm
    if saved is None:
        os.environ.pop("LITELLM_LOCAL_MODEL_COST_MAP", None)


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic on litellm's own TypedDicts
def test_litellm_openai_compatible_tool_call(
    litellm_module: Any, dialects: DialectGateway, model_name: str
) -> None:
    common: dict[str, Any] = {
        "model": "openai/" + model_name,
        "api_base": dialects.gateway.url + "/v1",
        "api_key": "unused",
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 40,
    }
    text = litellm_module.completion(**common)
    assert isinstance(text.choices[0].message.content, str)
    out = litellm_module.completion(**common, tools=[GET_TIME], tool_choice="required")
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME_SCHEMA)
