"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the reply is ``{"name": ..., "parameters": {...}}``
(``arguments`` is accepted too), optionally after ``<|python_tag|>``, several calls separated
by ``;``.  A call can only open the reply: text followed by JSON is an answer, not a call."""

from __future__ import annotations

from dataclasses import dataclass

from genserve.server.tool_calls.base import (
    ParsedCall,
    ParsedReply,
    call_from_object,
    decode_json_values,
)

_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class Llama3JsonParser:
    name: str = "llama3_json"
    start_markers: tuple[str, ...] = (_PYTHON_TAG, "{")
    at_start_only: bool = True
    needs_special_tokens: bool = False

    def parse(self, section: str) -> ParsedReply | None:
        body = section.strip()
        if body.startswith(_PYTHON_TAG):
            body = body[len(_PYTHON_TAG) :]
        values = decode_json_values(body, separators=";")
        if not values:
            return None
        calls: list[ParsedCall] = []
        for value in values:
            call = call_from_object(value, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
        return ParsedReply("", tuple(calls))
