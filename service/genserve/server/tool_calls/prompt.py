"""Conversations with tools, as the chat template sees them.

Templates that render ``tools`` (Qwen, Hermes, Llama 3.1+, Mistral) get them as they are.
A template that ignores them (SmolLM2's, for one) would silently drop them, so the server
then writes the tools and the Hermes call format into the system prompt itself, as TGI does
for models without tool support, and parses replies with the Hermes parser.  Earlier tool
calls of the conversation go back as ``tool_calls`` on the assistant messages (arguments as
objects, which is what templates iterate), or, for a template without tool support, as
the Hermes text the model was taught."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from genserve.server.tool_calls.tools import ToolSpec

_INSTRUCTIONS = (
    "You can call functions. The available functions, as JSON Schema, are:\n"
    "{tools}\n"
    "To call a function, reply with one line per call, each "
    '<tool_call>{{"name": <function name>, "arguments": <arguments object>}}</tool_call>, '
    "and nothing else. Otherwise answer normally."
)


def template_renders_tools(template: str | None) -> bool:
    """Whether a template uses the ``tools`` it is given."""
    return bool(template) and "tools" in (template or "")


def tool_system_prompt(tools: Sequence[ToolSpec]) -> str:
    listed = "\n".join(json.dumps(t.template_form(), ensure_ascii=False) for t in tools)
    return _INSTRUCTIONS.format(tools=listed)


def with_tool_prompt(
    messages: list[dict[str, Any]], tools: Sequence[ToolSpec]
) -> list[dict[str, Any]]:
    """``messages`` with the tool instructions added to (or as) the system message."""
    prompt = tool_system_prompt(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{prompt}".lstrip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def calls_as_text(calls: Sequence[tuple[str, str]]) -> str:
    """Earlier ``(name, arguments JSON)`` calls as the Hermes text the model was taught."""
    parts = []
    for name, arguments in calls:
        try:
            args: Any = json.loads(arguments) if arguments else {}
        except ValueError:
            args = arguments
        parts.append(
            "<tool_call>"
            + json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            + "</tool_call>"
        )
    return "\n".join(parts)


def calls_for_template(calls: Sequence[tuple[str, str, str]]) -> list[dict[str, Any]]:
    """Earlier ``(id, name, arguments JSON)`` calls in the shape templates iterate."""
    out = []
    for call_id, name, arguments in calls:
        try:
            args: Any = json.loads(arguments) if arguments else {}
        except ValueError:
            args = arguments
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
        if call_id:
            entry["id"] = call_id
        out.append(entry)
    return out
