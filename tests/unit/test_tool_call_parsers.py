"""Tool-call parsing on replies as real models write them (Qwen 2.5 / Hermes, Llama 3.x,
Mistral v3 and v11), whole and streamed token by token, including malformed replies, which
must come back as text (never an error)."""

from __future__ import annotations

import json

import pytest

from genserve.server.reasoning import reasoning_parser_named
from genserve.server.tool_calls import PARSERS, ToolCallParser, parser_named, plan_tools
from genserve.server.tool_calls.constrained import parse_named, parse_required, required_schema
from genserve.server.tool_calls.registry import choose_parser, parser_for_template
from genserve.server.tool_calls.stream import ToolCallStream
from genserve.server.tool_calls.tools import ToolRequestError, tool_spec
from genserve.v1 import generate_pb2 as pb

HERMES = parser_named("hermes")
LLAMA3 = parser_named("llama3_json")
MISTRAL = parser_named("mistral")

QWEN_TWO_CALLS = (
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
    'CA, USA", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_temperature_date", '
    '"arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": '
    '"celsius"}}\n</tool_call>'
)
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
MISTRAL_V3 = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}'


def split_whole(parser: ToolCallParser, text: str) -> tuple[str, list[tuple[str, dict]]]:
    stream = ToolCallStream(parser)
    content = stream.feed(text)
    rest, parsed = stream.finish()
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.calls] if parsed else []
    return content + rest, calls


def split_streamed(parser: ToolCallParser, text: str, step: int) -> tuple[str, list]:
    """Fed in pieces of ``step`` characters, as tokens arrive."""
    stream = ToolCallStream(parser)
    content = "".join(stream.feed(text[i : i + step]) for i in range(0, len(text), step))
    rest, parsed = stream.finish()
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.calls] if parsed else []
    return content + rest, calls


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_hermes_two_calls(step: int) -> None:
    content, calls = split_streamed(HERMES, QWEN_TWO_CALLS, step)
    assert content == ""
    assert [name for name, _ in calls] == ["get_current_temperature", "get_temperature_date"]
    assert calls[1][1] == {
        "location": "San Francisco, CA, USA",
        "date": "2024-10-01",
        "unit": "celsius",
    }


def test_hermes_text_before_call_streams_and_unclosed_call_parses() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}'  # stopped at EOS
    stream = ToolCallStream(HERMES)
    sent = "".join(stream.feed(ch) for ch in text)
    assert sent == "Let me check.\n"  # released before the marker, never the marker itself
    rest, parsed = stream.finish()
    assert rest == "" and parsed is not None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("f", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # missing brace
        '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',  # no name
        "<tool_call>\nnot json at all\n</tool_call>",
        '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        "<tool_call>",
    ],
)
def test_hermes_malformed_comes_back_as_text(text: str) -> None:
    for step in (1, len(text)):
        assert split_streamed(HERMES, text, step) == (text, [])


def test_hermes_plain_answer_is_content() -> None:
    text = "The weather in Paris is sunny. <tool is not a call"
    assert split_streamed(HERMES, text, 2) == (text, [])


def test_hermes_arguments_as_json_string() -> None:
    text = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>'
    assert split_whole(HERMES, text) == ("", [("f", {"x": 2})])


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_llama3_json(step: int) -> None:
    assert split_streamed(LLAMA3, LLAMA_CALL, step) == (
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    )
    tagged = "<|python_tag|>" + LLAMA_CALL + '; {"name": "g", "parameters": {}}'
    assert split_streamed(LLAMA3, tagged, step)[1] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("g", {}),
    ]


def test_llama3_json_only_at_the_start_and_malformed_as_text() -> None:
    answer = 'Here is JSON: {"name": "x", "parameters": {}}'
    assert split_streamed(LLAMA3, answer, 3) == (answer, [])
    broken = '{"name": "get_weather", "parameters": {"city": "Par'  # cut by max_tokens
    assert split_streamed(LLAMA3, broken, 5) == (broken, [])
    trailing = LLAMA_CALL + " and then some words"
    assert split_streamed(LLAMA3, trailing, 5) == (trailing, [])


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_mistral_both_layouts(step: int) -> None:
    assert split_streamed(MISTRAL, MISTRAL_V3, step) == ("", [("get_weather", {"city": "Paris"})])
    assert split_streamed(MISTRAL, MISTRAL_V11, step) == (
        "",
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1})],
    )
    assert MISTRAL.needs_special_tokens


def test_mistral_malformed_as_text() -> None:
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
    assert split_streamed(MISTRAL, text, 4) == (text, [])


def test_parser_choice() -> None:
    assert choose_parser("mistral", None) is MISTRAL
    assert parser_for_template("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert parser_for_template("<|start_header_id|>ipython<|end_header_id|>") is LLAMA3
    assert choose_parser(None, "{{ messages }}") is HERMES  # the format the server teaches
    with pytest.raises(ValueError, match="--tool-call-parser"):
        parser_named("nope")
    # The launcher's --tool-call-parser choices are exactly the registry's names.
    from genserve.config import FLAGS

    flag = next(f for f in FLAGS if f.dest == "tool_call_parser")
    assert set(flag.choices or ()) == set(PARSERS)
    flag = next(f for f in FLAGS if f.dest == "reasoning_parser")
    for name in flag.choices or ():
        reasoning_parser_named(name)


def tool(name: str, params: dict | None = None) -> pb.Tool:
    return pb.Tool(
        type="function",
        function=pb.FunctionDefinition(name=name, parameters=json.dumps(params) if params else ""),
    )


def test_plan_tools_checks() -> None:
    tools = [tool("a", {"type": "object"}), tool("b")]
    assert plan_tools(tools, None, True, HERMES).mode == "auto"
    assert plan_tools([], None, True, HERMES).mode == "none"
    named = plan_tools(tools, pb.ToolChoice(mode="function", function_name="b"), True, HERMES)
    assert named.grammar_schema == json.dumps({"type": "object"})
    for choice, message in (
        (pb.ToolChoice(mode="function", function_name="c"), "not in `tools`"),
        (pb.ToolChoice(mode="sometimes"), "tool_choice"),
    ):
        with pytest.raises(ToolRequestError, match=message):
            plan_tools(tools, choice, True, HERMES)
    with pytest.raises(ToolRequestError, match="needs `tools`"):
        plan_tools([], pb.ToolChoice(mode="required"), True, HERMES)
    with pytest.raises(ToolRequestError, match="twice"):
        plan_tools([tool("a"), tool("a")], None, True, HERMES)
    with pytest.raises(ToolRequestError, match="not JSON"):
        tool_spec(0, "function", "f", "", "{nope")
    with pytest.raises(ToolRequestError, match="only 'function'"):
        tool_spec(0, "retrieval", "f", "", "")


def test_constrained_replies() -> None:
    specs = plan_tools([tool("a"), tool("b")], None, True, HERMES).tools
    schema = json.loads(required_schema(specs, parallel=False))
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert "maxItems" not in json.loads(required_schema(specs, parallel=True))
    parsed = parse_required(
        '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]'
    )
    assert parsed is not None and [c.name for c in parsed.calls] == ["a", "b"]
    assert parse_required('[{"name": "a", "argum') is None  # cut short: text
    named = parse_named('{"x": [1, 2]}', "a")
    assert named is not None and json.loads(named.calls[0].arguments) == {"x": [1, 2]}
    assert parse_named('{"x": ', "a") is None


def test_auto_without_parallel_calls_keeps_the_first() -> None:
    tools = [tool("get_current_temperature"), tool("get_temperature_date")]
    for parallel, expected in ((True, 2), (False, 1)):
        reply = plan_tools(tools, None, parallel, HERMES).reply()
        assert reply.feed(QWEN_TWO_CALLS) == ""
        _, parsed = reply.finish()
        assert parsed is not None and len(parsed.calls) == expected
