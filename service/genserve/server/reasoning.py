"""``--reasoning-parser``: the ``<think>…</think>`` part of a reply goes to
``reasoning_content`` instead of ``content`` (unary and streamed).

Two behaviours, named as in vLLM and SGLang: ``qwen3`` only treats a reply that opens with
``<think>`` as reasoning (Qwen3 with thinking switched off writes none); ``deepseek_r1``
treats everything before ``</think>`` as reasoning, because DeepSeek-R1's template already
puts ``<think>`` in the prompt and the reply starts inside it.  A reply that never closes
its reasoning is all reasoning (it was cut short).

With a constraint (``response_format``, a grammar, ``tool_choice`` required or named) the
grammar leaves the reasoning free and applies from the end of it (:meth:`ReasoningParser.gate`,
``engine/grammar.py``'s ``after_reasoning``)."""

from __future__ import annotations

from dataclasses import dataclass

from genserve.engine.grammar_spec import ReasoningGate

_OPEN = "<think>"
_CLOSE = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the reply begins in the reasoning (no <think> needed)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def gate(self) -> ReasoningGate:
        """Where a constrained reply's grammar starts: after this reasoning section."""
        return ReasoningGate(_OPEN, _CLOSE, self.starts_inside)

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole reply."""
        s = self.stream()
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        return r1 + r2, c1 + c2


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
    "deepseek-r1": ReasoningParser("deepseek_r1", starts_inside=True),
}


def reasoning_parser_named(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--reasoning-parser {name!r} is not known; choose one of "
            f"{', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """Feed text deltas; each call returns (reasoning delta, content delta).  Text that may
    be the start of a tag is held back until the next delta shows what it is."""

    def __init__(self, parser: ReasoningParser) -> None:
        # "start": nothing decided yet; "reasoning"; "content".
        self._state = "reasoning" if parser.starts_inside else "start"
        self._opened = False  # <think> seen (or not needed)
        self._held = ""
        self._strip = False  # drop the newlines that follow </think>

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            if self._state == "content":
                if self._strip:
                    text = text.lstrip("\n")
                    self._strip = not text
                content.append(text)
                break
            if self._state == "start":
                stripped = text.lstrip()
                if not stripped or _OPEN.startswith(stripped):
                    self._held = text
                    break
                if stripped.startswith(_OPEN):
                    self._state = "reasoning"
                    self._opened = True
                    text = stripped[len(_OPEN) :]
                    continue
                self._state = "content"
                continue
            # reasoning: an optional leading <think>, then text up to </think>
            if not self._opened:
                stripped = text.lstrip()
                if not stripped or _OPEN.startswith(stripped):
                    self._held = text
                    break
                self._opened = True
                if stripped.startswith(_OPEN):
                    text = stripped[len(_OPEN) :]
                    continue
            end = text.find(_CLOSE)
            if end >= 0:
                reasoning.append(text[:end])
                self._state = "content"
                self._strip = True
                text = text[end + len(_CLOSE) :]
                continue
            hold = _partial(text, _CLOSE)
            reasoning.append(text[: len(text) - hold])
            self._held = text[len(text) - hold :] if hold else ""
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the reply."""
        held, self._held = self._held, ""
        if self._state == "content" or self._state == "start":
            return "", held
        return held, ""
