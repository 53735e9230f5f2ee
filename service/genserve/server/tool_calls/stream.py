"""Splitting one choice's reply into content and tool calls as its text arrives.

Content streams as soon as it cannot be the start of a tool-call section; from a start
marker on, the rest of the reply is held and parsed when the reply ends.  If it does not
parse, it is released as content: the client sees the model's text, never an error."""

from __future__ import annotations

from genserve.server.tool_calls.base import ParsedReply, ToolCallParser


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins some marker (so may complete it)."""
    hold = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), hold, -1):
            if text.endswith(marker[:k]):
                hold = k
                break
    return hold


class ToolCallStream:
    """Feed text deltas in order; each call returns the content that is safe to send."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._pending = ""  # text that may still begin a start marker
        self._section: str | None = None  # from the start marker on, once seen
        self._sent_any = False  # content (other than whitespace) already released

    def feed(self, delta: str) -> str:
        if self._section is not None:
            self._section += delta
            return ""
        text = self._pending + delta
        markers = self._parser.start_markers
        if self._parser.at_start_only:
            if self._sent_any:
                return self._release(text)
            stripped = text.lstrip()
            if not stripped:
                self._pending = text
                return ""
            if any(stripped.startswith(m) for m in markers):
                self._pending, self._section = "", stripped
                return ""
            if any(m.startswith(stripped) for m in markers):
                self._pending = text
                return ""
            return self._release(text)
        found = [i for i in (text.find(m) for m in markers) if i >= 0]
        if found:
            start = min(found)
            self._pending, self._section = "", text[start:]
            return self._release(text[:start], keep_pending=True)
        hold = _held_prefix(text, markers)
        self._pending = text[len(text) - hold :] if hold else ""
        return self._release(text[: len(text) - hold], keep_pending=True)

    def _release(self, text: str, keep_pending: bool = False) -> str:
        if not keep_pending:
            self._pending = ""
        if text.strip():
            self._sent_any = True
        return text

    def finish(self) -> tuple[str, ParsedReply | None]:
        """At the end of the reply: (content not yet sent, the parsed calls or None)."""
        if self._section is None:
            rest, self._pending = self._pending, ""
            return rest, None
        section, self._section = self._section, None
        parsed = self._parser.parse(section)
        if parsed is None:
            return section, None
        return parsed.content, parsed
