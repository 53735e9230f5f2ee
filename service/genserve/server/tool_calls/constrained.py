"""``tool_choice`` "required" and a named function: the reply is constrained by a JSON Schema
grammar (xgrammar), so it always parses and its arguments always validate.

As vLLM does, the constrained reply is plain JSON, whatever format the model's template
uses: a named call's reply is the arguments object itself; a required reply is a list of
``{"name", "arguments"}`` objects (one at most without parallel tool calls)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from genserve.server.tool_calls.base import ParsedCall, ParsedReply, call_from_object
from genserve.server.tool_calls.tools import ToolSpec


def named_schema(tool: ToolSpec) -> str:
    """The grammar for a call of ``tool``: its parameters' schema."""
    return json.dumps(tool.parameters)


def required_schema(tools: Sequence[ToolSpec], parallel: bool) -> str:
    """The grammar for at least one call of any of ``tools``."""
    variants: list[dict[str, Any]] = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.name]}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
    }
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def parse_named(text: str, name: str) -> ParsedReply | None:
    """The reply of a named choice (the arguments), or None when it is cut short."""
    try:
        args = json.loads(text)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    return ParsedReply("", (ParsedCall(name, json.dumps(args, ensure_ascii=False)),))


def parse_required(text: str) -> ParsedReply | None:
    """The reply of a required choice (a list of calls), or None when it is cut short."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_object(item) for item in items]
    if any(c is None for c in calls):
        return None
    return ParsedReply("", tuple(c for c in calls if c is not None))
