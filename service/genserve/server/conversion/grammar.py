"""GenerateParameters.grammar → a compiled grammar on the request, before it is queued.

An empty or malformed grammar and one the compiler rejects are :class:`ValidationError`
(INVALID_ARGUMENT, the compiler's message unchanged); a server started with
--disable-grammar-support refuses any grammar with :class:`GrammarUnsupportedError`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from genserve.engine.grammar_spec import GrammarError, GrammarKind, GrammarSpec, ReasoningGate
from genserve.engine.outputs import GenerationRequest
from genserve.server.conversion.errors import GrammarUnsupportedError, ValidationError
from genserve.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from genserve.engine.grammar import GrammarCompiler


def grammar_spec(params: pb.GenerateParameters) -> GrammarSpec | None:
    """The request's grammar, or None; raises :class:`GrammarError` on an empty one."""
    if not params.HasField("grammar"):
        return None
    grammar = params.grammar
    kind = grammar.WhichOneof("kind")
    if kind is None:
        raise GrammarError("`grammar` is set but none of its kinds is")
    if kind == "json_object":
        if not grammar.json_object:
            raise GrammarError("`grammar.json_object` must be true when set")
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    if kind == "choice":
        values = list(grammar.choice.values)
        if not values or any(not v for v in values):
            raise GrammarError("`grammar.choice` needs at least one value and no empty values")
        return GrammarSpec.choice(values)
    text = str(getattr(grammar, kind))
    if not text:
        raise GrammarError(f"`grammar.{kind}` cannot be empty")
    return GrammarSpec(GrammarKind(kind), text)


async def attach_grammar(
    req: GenerationRequest,
    params: pb.GenerateParameters,
    compiler: GrammarCompiler | None,
    reasoning: ReasoningGate | None = None,
) -> GenerationRequest:
    """``req`` with its compiled grammar (cached by text, compiled off the event loop).
    ``reasoning``: the grammar applies only after that reasoning section (a chat reply of a
    server started with --reasoning-parser)."""
    try:
        spec = grammar_spec(params)
        if spec is None:
            return req
        if reasoning is not None:
            spec = dataclasses.replace(spec, reasoning=reasoning)
        if compiler is None:
            raise GrammarUnsupportedError(
                "structured output (`grammar`) is disabled on this server "
                "(--disable-grammar-support)"
            )
        return dataclasses.replace(req, grammar=await compiler.compile(spec))
    except GrammarError as exc:
        raise ValidationError(str(exc)) from None
