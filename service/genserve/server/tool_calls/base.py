"""The contract every tool-call format implements, and the shapes parsed calls take.

A parser reads the *detokenized* reply text of one choice (never token ids: formats are
defined on text, and the server already assembles exact text for stop sequences).  It
splits the reply into plain content and calls; a reply it cannot read completely (invalid
JSON, a missing name, an unclosed section) is not a tool call at all, and the caller returns
it as text: a malformed model output never becomes an error."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """One call: the function's name and its arguments as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedReply:
    """A reply split into the text around the calls and the calls, in order (at least one)."""

    content: str
    calls: tuple[ParsedCall, ...]


class ToolCallParser(Protocol):
    """One tool-call format.

    ``start_markers`` are the texts that open a tool-call section; while a streamed reply
    might still turn into one, the stream holds its text back.  With ``at_start_only`` a
    section can only open the reply (after whitespace), as in Llama 3's bare JSON format.
    ``needs_special_tokens``: the markers are special tokens, so the reply must be
    detokenized with them (Mistral's ``[TOOL_CALLS]``)."""

    @property
    def name(self) -> str: ...

    @property
    def start_markers(self) -> tuple[str, ...]: ...

    @property
    def at_start_only(self) -> bool: ...

    @property
    def needs_special_tokens(self) -> bool: ...

    def parse(self, section: str) -> ParsedReply | None:
        """``section`` starts at a start marker (with the content before it removed): the
        calls it holds plus any trailing content, or None when it is not well formed."""
        ...


def new_call_id() -> str:
    """An OpenAI-style id (``call_`` and 24 hex digits); unique per call."""
    return "call_" + secrets.token_hex(12)


def call_from_object(
    obj: Any, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ParsedCall | None:
    """``{"name": str, "arguments" | "parameters": object or JSON text}`` as a call; None for
    anything else (the whole reply is then text)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def decode_json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values ``text`` is made of (separated by whitespace or ``separators``
    characters), or None when anything else is in it."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    skip = set(" \t\r\n" + separators)
    while True:
        while pos < len(text) and text[pos] in skip:
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
