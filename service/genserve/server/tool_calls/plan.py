"""A Chat request's tools and tool_choice → what the reply is constrained to and how it is
read back (one :class:`ToolPlan` per call, one :class:`ToolReply` per choice)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from genserve.server.tool_calls.base import ParsedReply, ToolCallParser
from genserve.server.tool_calls.constrained import (
    named_schema,
    parse_named,
    parse_required,
    required_schema,
)
from genserve.server.tool_calls.stream import ToolCallStream
from genserve.server.tool_calls.tools import ToolRequestError, ToolSpec, tool_spec
from genserve.v1 import generate_pb2 as pb

MODES = ("auto", "none", "required", "function")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """``mode`` is one of MODES; ``grammar_schema`` the JSON Schema a required or named
    reply is constrained to (None otherwise)."""

    mode: str
    tools: tuple[ToolSpec, ...]
    parser: ToolCallParser
    function_name: str = ""
    grammar_schema: str | None = None
    parallel: bool = True  # more than one call per reply (auto keeps only the first if not)

    @property
    def active(self) -> bool:
        """Whether replies may hold tool calls."""
        return self.mode != "none"

    def reply(self) -> ToolReply:
        return ToolReply(self)


NO_TOOLS_MODE = "none"


def plan_tools(
    tools: Sequence[pb.Tool],
    choice: pb.ToolChoice | None,
    parallel: bool,
    parser: ToolCallParser,
) -> ToolPlan:
    """Raises :class:`ToolRequestError` for unusable tools or a choice naming none of them."""
    specs = tuple(
        tool_spec(i, t.type, t.function.name, t.function.description, t.function.parameters)
        for i, t in enumerate(tools)
    )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ToolRequestError("`tools` names a function twice")
    mode = (choice.mode if choice is not None else "") or ("auto" if specs else "none")
    if mode not in MODES:
        raise ToolRequestError(
            f"tool_choice is {mode!r}; expected 'auto', 'none', 'required' or a function"
        )
    if mode != "none" and not specs:
        raise ToolRequestError(f"tool_choice {mode!r} needs `tools`")
    if mode == "function":
        name = choice.function_name if choice is not None else ""
        chosen = [s for s in specs if s.name == name]
        if not chosen:
            raise ToolRequestError(
                f"tool_choice names function {name!r}, which is not in `tools` ({', '.join(names)})"
            )
        return ToolPlan(mode, specs, parser, name, named_schema(chosen[0]), parallel)
    if mode == "required":
        schema = required_schema(specs, parallel)
        return ToolPlan(mode, specs, parser, "", schema, parallel)
    return ToolPlan(mode, specs, parser, parallel=parallel)


class ToolReply:
    """One choice's reply text → content deltas, then at the end the calls (if any).

    Auto: content streams until a start marker of the parser's format, then the rest is
    parsed at the end.  Required / named: the reply is JSON meant for the calls, held whole
    (a reply cut short by max_tokens is returned as text).  None: text passes through."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._stream = ToolCallStream(plan.parser) if plan.mode == "auto" else None
        self._held: list[str] = []

    def feed(self, delta: str) -> str:
        if self._stream is not None:
            return self._stream.feed(delta)
        if self._plan.mode in ("required", "function"):
            self._held.append(delta)
            return ""
        return delta

    def finish(self) -> tuple[str, ParsedReply | None]:
        """(content not yet released, the calls or None)."""
        if self._stream is not None:
            rest, parsed = self._stream.finish()
            if parsed is not None and not self._plan.parallel and len(parsed.calls) > 1:
                # parallel_tool_calls false: the first call only, as OpenAI answers.
                parsed = ParsedReply(parsed.content, parsed.calls[:1])
            return rest, parsed
        if self._plan.mode == "none":
            return "", None
        text = "".join(self._held)
        if self._plan.mode == "function":
            parsed = parse_named(text, self._plan.function_name)
        else:
            parsed = parse_required(text)
        return ("", parsed) if parsed is not None else (text, None)
