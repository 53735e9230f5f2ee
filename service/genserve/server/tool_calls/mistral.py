"""Mistral tool calls after the ``[TOOL_CALLS]`` token, in either of Mistral's layouts:
``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (tokenizer v3, Mistral 7B v0.3 /
Nemo) or ``[TOOL_CALLS]name[ARGS]{...}`` repeated (tokenizer v11+, Mistral Small 3.2 and
later).  ``[TOOL_CALLS]`` is a special token: replies are detokenized with special tokens."""

from __future__ import annotations

from dataclasses import dataclass

from genserve.server.tool_calls.base import (
    ParsedCall,
    ParsedReply,
    call_from_object,
    decode_json_values,
)

_MARKER = "[TOOL_CALLS]"
_ARGS = "[ARGS]"


@dataclass(frozen=True, slots=True)
class MistralParser:
    name: str = "mistral"
    start_markers: tuple[str, ...] = (_MARKER,)
    at_start_only: bool = False
    needs_special_tokens: bool = True

    def parse(self, section: str) -> ParsedReply | None:
        body = section.removeprefix(_MARKER).strip()
        if _ARGS in body:
            return _parse_v11(body)
        values = decode_json_values(body)
        if values is None or len(values) != 1:
            return None
        items = values[0] if isinstance(values[0], list) else [values[0]]
        calls: list[ParsedCall] = []
        for item in items:
            call = call_from_object(item)
            if call is None:
                return None
            calls.append(call)
        return ParsedReply("", tuple(calls)) if calls else None


def _parse_v11(body: str) -> ParsedReply | None:
    calls: list[ParsedCall] = []
    for part in body.split(_MARKER):
        name, sep, args = part.partition(_ARGS)
        if not sep:
            return None
        values = decode_json_values(args)
        if values is None or len(values) != 1:
            return None
        call = call_from_object({"name": name.strip(), "arguments": values[0]})
        if call is None:
            return None
        calls.append(call)
    return ParsedReply("", tuple(calls))
