"""The step's grammar masks as the engine computes them: one xgrammar batch call fills every
constrained row (the same rows as one matcher at a time), in a worker thread off the caller's,
into a reused buffer; the word-wise :func:`apply_bitmask` gives exactly xgrammar's own CPU
kernel's result; grammars compile in the compile thread, not the event loop's."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from genserve.engine.grammar import (
    BitmaskFiller,
    GrammarCompiler,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
)
from genserve.engine.grammar_spec import GrammarKind, GrammarSpec
from genserve.model.loader import resolve_model
from genserve.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}
# Prefixes that put the matcher in different places: structure, inside a string, a number.
PREFIXES = [
    "",
    '{"title": "',
    '{"title": "Dune", "year": 19',
    '{"title": "x", "year": 1, "tags": [',
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    model_dir: Path = resolve_model(None).local_dir
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))


def _states(compiler: GrammarCompiler, tokenizer: Tokenizer) -> list[GrammarState]:
    compiled = compiler.compile_sync(GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    states = []
    for prefix in PREFIXES * 2:
        state = compiled.new_state()
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert state.accept(token), prefix
        states.append(state)
    return states


def test_batch_fill_matches_one_matcher_at_a_time(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    states = _states(compiler, tokenizer)
    one_by_one = allocate_bitmask(len(states), compiler.vocab_size)
    for row, state in enumerate(states):
        state.fill_bitmask(one_by_one, row)
    batched = allocate_bitmask(len(states), compiler.vocab_size)
    GrammarState.fill_batch(states, batched)
    assert torch.equal(batched, one_by_one)
    # The rows differ (structure vs inside a string), so this compares real masks.
    assert len({tuple(r.tolist()) for r in batched}) == len(PREFIXES)


def test_filler_runs_off_the_callers_thread_and_reuses_its_buffer(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    states = _states(compiler, tokenizer)
    expected = allocate_bitmask(len(states), compiler.vocab_size)
    GrammarState.fill_batch(states, expected)
    threads: list[str] = []

    class Recording(GrammarState):
        @staticmethod
        def fill_batch(states: list[GrammarState], bitmask: torch.Tensor) -> None:  # type: ignore[override]
            threads.append(threading.current_thread().name)
            GrammarState.fill_batch(states, bitmask)

    recording = [Recording(s._matcher, s.vocab_size) for s in states]
    filler = BitmaskFiller()
    try:
        first = filler.start(recording).wait()
        assert torch.equal(first, expected)
        smaller = filler.start(recording[:3]).wait()
        assert torch.equal(smaller, expected[:3])
        assert smaller.data_ptr() == first.data_ptr()  # the same buffer, no new allocation
    finally:
        filler.shutdown()
    assert threads and all(name.startswith("grammar-mask") for name in threads)


@pytest.mark.parametrize("vocab", [49152, 49152 + 64, 1000, 77])
def test_apply_bitmask_equals_xgrammars_kernel(vocab: int) -> None:
    """Words all 0, all 1 and mixed, a partial last word, masks on a subset of rows."""
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (6, words), dtype=torch.int32, generator=gen)
    kind = torch.randint(0, 3, (6, words), generator=gen)
    bitmask[kind == 0] = 0
    bitmask[kind == 1] = -1
    logits = torch.randn(9, vocab, generator=gen)
    rows = [0, 2, 3, 5, 7, 8]
    expected = logits.clone()
    by_row = torch.zeros(9, words, dtype=torch.int32)
    by_row[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, by_row, indices=rows)
    got = logits.clone()
    apply_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 4, 6]], logits[[1, 4, 6]])  # other rows untouched
    every = logits[:6].clone()
    apply_bitmask(every, bitmask, list(range(6)))
    expected_every = logits[:6].clone()
    xgr.apply_token_bitmask_inplace(expected_every, bitmask)
    assert torch.equal(every, expected_every)


def test_compile_runs_in_the_compile_thread(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))
    names: list[str] = []
    compile_sync = compiler.compile_sync

    def recording(spec: GrammarSpec):  # type: ignore[no-untyped-def]
        names.append(threading.current_thread().name)
        return compile_sync(spec)

    compiler.compile_sync = recording  # type: ignore[method-assign]
    spec = GrammarSpec(GrammarKind.REGEX, "[a-z]{3}")

    async def both() -> tuple[object, object]:
        loop_thread = threading.current_thread().name
        first = await compiler.compile(spec)
        second = await compiler.compile(spec)  # cached: no second compilation
        assert loop_thread not in names
        return first, second

    first, second = asyncio.run(both())
    assert first is second
    assert len(names) == 1 and names[0].startswith("grammar-compile")
    compiler.shutdown()
