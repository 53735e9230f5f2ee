"""Hermes / Qwen 2.5 / Qwen 3 tool calls: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, one section per call, possibly after some text.  It is also the format the
server teaches models whose template knows nothing of tools (see ``prompt.py``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from genserve.server.tool_calls.base import (
    ParsedCall,
    ParsedReply,
    call_from_object,
    decode_json_values,
)

_OPEN = "<tool_call>"
# A section, or an unclosed last one (models often stop at end-of-sequence instead).
_SECTION = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True, slots=True)
class HermesParser:
    name: str = "hermes"
    start_markers: tuple[str, ...] = (_OPEN,)
    at_start_only: bool = False
    needs_special_tokens: bool = False

    def parse(self, section: str) -> ParsedReply | None:
        calls: list[ParsedCall] = []
        content: list[str] = []
        pos = 0
        for match in _SECTION.finditer(section):
            content.append(section[pos : match.start()])
            pos = match.end()
            body = match.group(1).strip()
            values = decode_json_values(body)
            if not values or len(values) != 1:
                return None
            call = call_from_object(values[0])
            if call is None:
                return None
            calls.append(call)
        content.append(section[pos:])
        if not calls:
            return None
        return ParsedReply("".join(content).strip(), tuple(calls))
