"""A chat choice's reply text → OpenAI's message parts: content, reasoning_content and
tool_calls, for a whole reply (Chat) or token by token (ChatStream).

Reasoning is split first (``--reasoning-parser``), then the content after it goes through
the call's tool plan (``tool_calls/``).  Both work on the detokenized text the engine
produces, so unary and streamed replies split the same way."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from genserve.server.reasoning import ReasoningParser, ReasoningStream
from genserve.server.tool_calls import ToolCallParser, ToolPlan, ToolReply, new_call_id
from genserve.v1 import generate_pb2 as pb


@dataclass(frozen=True, slots=True)
class ChatFeatures:
    """The server's chat options: the tool-call format replies are parsed with, the
    reasoning format (None: off), and the fingerprint replies carry."""

    tool_parser: ToolCallParser
    reasoning: ReasoningParser | None = None
    system_fingerprint: str = ""


def system_fingerprint(version: str, model_id: str, model_sha: str, dtype: str) -> str:
    """OpenAI's ``fp_…``: the same for every reply of one server build and model."""
    digest = hashlib.sha256(f"{version}\0{model_id}\0{model_sha}\0{dtype}".encode()).hexdigest()
    return "fp_" + digest[:10]


@dataclass(slots=True)
class ReplyPiece:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[pb.ToolCall] = field(default_factory=list)


class ChoiceReply:
    """Feed one choice's text deltas in order, then call :meth:`finish` once."""

    def __init__(self, tools: ToolPlan, reasoning: ReasoningParser | None) -> None:
        self._tools: ToolReply = tools.reply()
        self._reasoning: ReasoningStream | None = reasoning.stream() if reasoning else None

    def feed(self, delta: str) -> ReplyPiece:
        if self._reasoning is None:
            return ReplyPiece(content=self._tools.feed(delta))
        thought, content = self._reasoning.feed(delta)
        return ReplyPiece(content=self._tools.feed(content) if content else "", reasoning=thought)

    def finish(self) -> ReplyPiece:
        piece = ReplyPiece()
        if self._reasoning is not None:
            thought, content = self._reasoning.finish()
            piece.reasoning = thought
            piece.content = self._tools.feed(content) if content else ""
        rest, parsed = self._tools.finish()
        piece.content += rest
        if parsed is not None:
            piece.tool_calls = [
                pb.ToolCall(
                    id=new_call_id(),
                    type="function",
                    function=pb.FunctionCall(name=c.name, arguments=c.arguments),
                )
                for c in parsed.calls
            ]
        return piece


def whole_reply(text: str, tools: ToolPlan, reasoning: ReasoningParser | None) -> ReplyPiece:
    """The parts of a finished reply."""
    reply = ChoiceReply(tools, reasoning)
    first = reply.feed(text)
    last = reply.finish()
    return ReplyPiece(
        content=first.content + last.content,
        reasoning=first.reasoning + last.reasoning,
        tool_calls=last.tool_calls,
    )
