"""What a client asks structured output to follow, as plain data (no xgrammar, no torch):
the server validates requests with it; :mod:`genserve.engine.grammar` compiles it."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass


class GrammarError(ValueError):
    """The grammar text is invalid (message from xgrammar); answered with INVALID_ARGUMENT."""


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    EBNF = "ebnf"
    CHOICE = "choice"


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """A reasoning section the grammar leaves free before it applies (``--reasoning-parser``).

    ``starts_inside``: the reply begins inside the reasoning (DeepSeek-R1's template ends the
    prompt with the open tag), so the reply must close it before the constrained part;
    otherwise the reply may open with ``open_tag … close_tag`` or go straight to the
    constrained part (Qwen3, whose thinking can be switched off).  Up to two newlines may
    follow the close tag, as the models write them."""

    open_tag: str
    close_tag: str
    starts_inside: bool


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """``text`` is the schema, regex or EBNF; for CHOICE a JSON array of the strings; empty
    for JSON_OBJECT.  ``reasoning``: the grammar applies only after that reasoning section
    (None: from the first generated token)."""

    kind: GrammarKind
    text: str = ""
    reasoning: ReasoningGate | None = None

    @staticmethod
    def choice(values: list[str]) -> GrammarSpec:
        return GrammarSpec(GrammarKind.CHOICE, json.dumps(values, ensure_ascii=False))


def choice_ebnf(values: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``values`` (literals in JSON string syntax,
    which xgrammar's EBNF reads: quotes, backslashes and control characters escaped)."""
    literals = " | ".join(json.dumps(v, ensure_ascii=False) for v in values)
    return f"root ::= {literals}"
