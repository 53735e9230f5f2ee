"""Issue #27: a constraint together with --reasoning-parser.  The grammar leaves the
``<think>…</think>`` section free and applies from its end, on the default model's real
tokenizer (where the tags are several tokens each, so the matcher must follow text across
token boundaries)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genserve.engine.grammar import CompiledGrammar, GrammarCompiler, allocate_bitmask
from genserve.engine.grammar_spec import GrammarKind, GrammarSpec
from genserve.model.loader import resolve_model
from genserve.server.reasoning import reasoning_parser_named
from genserve.tokenizer import Tokenizer

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    model_dir: Path = resolve_model(None).local_dir
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))


def compiled(
    compiler: GrammarCompiler, parser: str, kind: GrammarKind, text: str
) -> CompiledGrammar:
    gate = reasoning_parser_named(parser).gate()
    return compiler.compile_sync(GrammarSpec(kind, text, reasoning=gate))


def accepts(grammar: CompiledGrammar, tokenizer: Tokenizer, text: str, *, end: bool) -> bool:
    """Every token of ``text`` is allowed (and, with ``end``, then end-of-sequence)."""
    state = grammar.new_state()
    ids = tokenizer.hf(text, add_special_tokens=False)["input_ids"]
    if not all(state.accept(i) for i in ids):
        return False
    return not end or state.accept(sorted(tokenizer.eos_token_ids)[0])


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ('<think>Is it? Let me count: 1, 2, "3" {.</think>\n\n{"answer": "yes"}', True),
        ('{"answer": "no"}', True),  # thinking switched off: no reasoning section
        ("<think>free text</think>\nnot json", False),
        ('<think>free text</think>\n{"answer": "maybe"}', False),
        ('Hello {"answer": "no"}', False),  # text before the reply that is not reasoning
    ],
)
def test_qwen3_reasoning_is_free_then_the_schema_applies(
    compiler: GrammarCompiler, tokenizer: Tokenizer, text: str, ok: bool
) -> None:
    grammar = compiled(compiler, "qwen3", GrammarKind.JSON_SCHEMA, SCHEMA)
    assert accepts(grammar, tokenizer, text, end=True) is ok


def test_deepseek_r1_reply_starts_inside_the_reasoning(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    grammar = compiled(compiler, "deepseek_r1", GrammarKind.REGEX, "(yes|no)")
    assert accepts(grammar, tokenizer, "Hmm, think: yes or no?</think>\nno", end=True)
    assert not accepts(grammar, tokenizer, "Hmm.</think>maybe", end=True)
    # The reasoning must end before the constrained part: an unclosed reply cannot end.
    assert accepts(grammar, tokenizer, "still thinking", end=False)
    assert not accepts(grammar, tokenizer, "still thinking", end=True)


def test_inside_the_reasoning_every_token_is_allowed(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """The reasoning is not constrained: the whole vocabulary (less end-of-sequence) is
    allowed, where the plain schema allows only a few tokens."""
    vocab = compiler.vocab_size
    bitmask = allocate_bitmask(2, vocab)
    gated = compiled(compiler, "deepseek_r1", GrammarKind.JSON_SCHEMA, SCHEMA).new_state()
    assert gated.accept(tokenizer.hf("Let", add_special_tokens=False)["input_ids"][0])
    gated.fill_bitmask(bitmask, 0)
    compiler.compile_sync(GrammarSpec(GrammarKind.JSON_SCHEMA, SCHEMA)).new_state().fill_bitmask(
        bitmask, 1
    )
    allowed = _unpack(bitmask, vocab)
    assert int(allowed[0].sum()) >= vocab - len(tokenizer.eos_token_ids) - 1
    assert int(allowed[1].sum()) < 10


def test_every_grammar_kind_composes_with_reasoning(compiler: GrammarCompiler) -> None:
    for kind, text in [
        (GrammarKind.JSON_OBJECT, ""),
        (GrammarKind.EBNF, 'root ::= "a" | "b"'),
        (GrammarKind.CHOICE, json.dumps(["red", "green"])),
    ]:
        compiled(compiler, "qwen3", kind, text)  # compiles without error


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool from xgrammar's packed int32 bitmask."""
    bits = torch.arange(32, dtype=torch.int32)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1
    return unpacked.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
