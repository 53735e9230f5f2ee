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
class GrammarSpec:
    """``text`` is the schema, regex or EBNF; for CHOICE a JSON array of the strings; empty
    for JSON_OBJECT."""

    kind: GrammarKind
    text: str = ""

    @staticmethod
    def choice(values: list[str]) -> GrammarSpec:
        return GrammarSpec(GrammarKind.CHOICE, json.dumps(values, ensure_ascii=False))


def choice_ebnf(values: list[str]) -> str:
    """An EBNF grammar matching exactly one of ``values`` (literals in JSON string syntax,
    which xgrammar's EBNF reads: quotes, backslashes and control characters escaped)."""
    literals = " | ".join(json.dumps(v, ensure_ascii=False) for v in values)
    return f"root ::= {literals}"
