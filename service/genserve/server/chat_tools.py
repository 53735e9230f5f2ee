"""The tool and reasoning half of planning a Chat call: what the template is given, what
every choice is constrained to, and which combinations are refused.

Kept apart from ``chat.py`` so that the conversation checks and the request conversion stay
small; ``chat.plan_chat`` calls :func:`plan_chat_tools` once per call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from genserve.server.chat_reply import ChatFeatures
from genserve.server.reasoning import ReasoningParser
from genserve.server.tool_calls import ToolPlan, plan_tools
from genserve.server.tool_calls.prompt import (
    calls_as_text,
    calls_for_template,
    template_renders_tools,
    with_tool_prompt,
)
from genserve.server.tool_calls.registry import choose_parser
from genserve.v1 import generate_pb2 as pb


class ChatToolsError(ValueError):
    """INVALID_ARGUMENT: unusable tools, or a combination this server refuses."""


@dataclass(frozen=True, slots=True)
class ChatToolsPlan:
    tools: ToolPlan
    reasoning: ReasoningParser | None
    template_tools: list[dict[str, Any]] | None  # given to the template's `tools`
    teach_tools: bool  # the template ignores tools: the server writes them in the prompt
    template_knows_tools: bool  # earlier calls go back as `tool_calls`, not as text
    system_fingerprint: str

    def messages(self, request_messages: Any) -> list[dict[str, Any]]:
        """The conversation as the template gets it."""
        out = [self._message(m) for m in request_messages]
        if self.teach_tools:
            out = with_tool_prompt(out, self.tools.tools)
        return out

    def _message(self, m: pb.ChatMessage) -> dict[str, Any]:
        # "developer" is OpenAI's newer "system"; templates know only the latter.
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
            if not self.template_knows_tools:  # the model learnt the Hermes text form
                text = calls_as_text([(name, args) for _, name, args in calls])
                message["content"] = f"{m.content}\n{text}".lstrip("\n")
            else:
                message["tool_calls"] = calls_for_template(calls)
        return message


def plan_chat_tools(
    request: pb.ChatRequest | pb.ChatStreamRequest,
    features: ChatFeatures | None,
    template: str | None,
    constrained_elsewhere: bool,
) -> ChatToolsPlan:
    """``constrained_elsewhere``: response_format or parameters.grammar is set."""
    parser = features.tool_parser if features is not None else choose_parser(None, template)
    reasoning = features.reasoning if features is not None else None
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    try:
        tools = plan_tools(
            request.tools,
            request.tool_choice if request.HasField("tool_choice") else None,
            parallel,
            parser,
        )
    except ValueError as exc:
        raise ChatToolsError(str(exc)) from None
    if tools.grammar_schema is not None and constrained_elsewhere:
        raise ChatToolsError(
            f"tool_choice {tools.mode!r} constrains the reply itself: it cannot be combined "
            "with `response_format` or `parameters.grammar`"
        )
    # With a reasoning parser a constraint applies after the reasoning ends (the grammar
    # leaves the <think> section free: conversion passes the parser's gate to the grammar).
    renders = template_renders_tools(template)
    active = tools.active
    return ChatToolsPlan(
        tools=tools,
        reasoning=reasoning,
        template_tools=[t.template_form() for t in tools.tools] if active and renders else None,
        teach_tools=active and not renders,
        template_knows_tools=renders,
        system_fingerprint=features.system_fingerprint if features is not None else "",
    )
