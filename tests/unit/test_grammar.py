"""Grammar-constrained sampling on xgrammar with the default model's real tokenizer: the
packed bitmask changes only the constrained rows of a batch, the compiler caches by text and
reports bad grammars, and masks span logits wider than the tokenizer's vocabulary."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from genserve.engine.grammar import GrammarCompiler, allocate_bitmask
from genserve.engine.grammar_spec import GrammarError, GrammarKind, GrammarSpec
from genserve.model.loader import resolve_model
from genserve.step import SamplingParams
from genserve.tokenizer import Tokenizer
from genserve.worker.sampler import Sampler, SamplingRow


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    model_dir: Path = resolve_model(None).local_dir
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids))


def _mask_rows(compiler: GrammarCompiler, specs: list[GrammarSpec]) -> torch.Tensor:
    bitmask = allocate_bitmask(len(specs), compiler.vocab_size)
    for row, spec in enumerate(specs):
        compiler.compile_sync(spec).new_state().fill_bitmask(bitmask, row)
    return bitmask


def test_mask_changes_only_the_constrained_rows(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, compiler.vocab_size)
    original = logits.clone()
    digits = GrammarSpec(GrammarKind.REGEX, "[0-9]+")
    bitmask = _mask_rows(compiler, [digits, digits])
    greedy = SamplingRow(SamplingParams(), 0)
    sampled = SamplingRow(SamplingParams(temperature=1.0, seed=3), 0)
    rows = [greedy, greedy, sampled, sampled]
    out = Sampler(torch.device("cpu"))(logits, rows, bitmask, [1, 3])
    assert torch.equal(logits, original)  # the model's logits are not modified
    unconstrained = Sampler(torch.device("cpu"))(original, rows)
    # Rows 0 and 2 are exactly what they are without any grammar in the batch.
    assert out.token_ids[0] == unconstrained.token_ids[0]
    assert out.token_ids[2] == unconstrained.token_ids[2]
    assert out.logprobs[0] == unconstrained.logprobs[0]
    for row in (1, 3):
        assert re.fullmatch("[0-9]+", tokenizer.token_text(out.token_ids[row]))
    # The greedy constrained row takes the best allowed token.
    allowed = [
        t for t in range(tokenizer.vocab_size) if re.fullmatch("[0-9]+", tokenizer.token_text(t))
    ]
    best = max(allowed, key=lambda t: float(original[1, t]))
    assert out.token_ids[1] == best
    # Reported logprobs stay those of the unmodified distribution.
    assert out.logprobs[1] == pytest.approx(float(torch.log_softmax(original[1], -1)[best]))


def test_eos_allowed_only_where_the_grammar_is_complete(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    eos = min(tokenizer.eos_token_ids)
    state = compiler.compile_sync(GrammarSpec.choice(["yes", "yesterday"])).new_state()
    bitmask = allocate_bitmask(1, compiler.vocab_size)

    def allowed() -> set[int]:
        state.fill_bitmask(bitmask, 0)
        logits = torch.zeros(1, compiler.vocab_size)
        from genserve.worker.grammar_mask import apply_bitmask

        apply_bitmask(logits, bitmask, [0])
        return set((logits[0] == 0).nonzero()[:, 0].tolist())

    assert eos not in allowed()
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert state.accept(token)
    after_yes = allowed()
    assert eos in after_yes and len(after_yes) > 1  # complete, or go on to "yesterday"
    assert state.accept(eos) and state.is_terminated
    assert not state.accept(tokenizer.encode("x", add_special_tokens=False)[0])


def test_compiled_grammars_are_cached_by_text_and_bounded(tokenizer: Tokenizer) -> None:
    small = GrammarCompiler(
        tokenizer.hf, tokenizer.vocab_size, sorted(tokenizer.eos_token_ids), cache_size=2
    )
    a, b, c = (GrammarSpec(GrammarKind.REGEX, r) for r in ("a+", "b+", "c+"))
    first = small.compile_sync(a)
    assert small.compile_sync(GrammarSpec(GrammarKind.REGEX, "a+")) is first
    small.compile_sync(b)
    small.compile_sync(c)  # evicts a, the least recently used
    assert small.compile_sync(a) is not first
    small.shutdown()


def test_on_compile_hears_of_cache_misses_only(compiler: GrammarCompiler) -> None:
    """--engine-process's front tells the engine process of each spec it is about to
    compile (so both compile at once), not of cache hits."""
    heard: list[GrammarSpec] = []
    compiler.on_compile = heard.append
    spec = GrammarSpec(GrammarKind.REGEX, "[0-9]{2}z")
    try:
        asyncio.run(compiler.compile(spec))
        asyncio.run(compiler.compile(spec))
    finally:
        compiler.on_compile = None
    assert heard == [spec]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec(GrammarKind.JSON_SCHEMA, "{bad"), "not valid JSON"),
        (GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "nope"})), "nope"),
        (GrammarSpec(GrammarKind.REGEX, "(ab"), "parenthesis"),
        (GrammarSpec(GrammarKind.EBNF, "root ::= missing"), "missing"),
    ],
)
def test_bad_grammars_raise_with_xgrammars_message(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(GrammarError, match=message) as err:
        compiler.compile_sync(spec)
    assert not str(err.value).split(": ", 1)[1].startswith("[")  # log prefix stripped


def test_logits_wider_than_the_tokenizer(tokenizer: Tokenizer) -> None:
    """Padded vocabularies (logits wider than the tokenizer): ids past the tokenizer are
    never allowed, whatever the grammar."""
    wide = tokenizer.vocab_size + 64
    compiler = GrammarCompiler(tokenizer.hf, wide, sorted(tokenizer.eos_token_ids))
    bitmask = _mask_rows(compiler, [GrammarSpec(GrammarKind.JSON_OBJECT)])
    logits = torch.zeros(1, wide)
    logits[0, tokenizer.vocab_size :] = 100.0  # the padding would win if allowed
    out = Sampler(torch.device("cpu"))(logits, [SamplingRow(SamplingParams(), 0)], bitmask, [0])
    assert out.token_ids[0] < tokenizer.vocab_size
    assert tokenizer.token_text(out.token_ids[0]).startswith("{")
    compiler.shutdown()


def test_batch_fill_matches_per_row_fill_and_reuses_its_buffers(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """The step's one batched fill (in the grammar thread) writes what each matcher's own
    fill would, and alternates between two buffers allocated once."""
    from genserve.engine.grammar import BitmaskFiller

    specs = [GrammarSpec(GrammarKind.REGEX, "[0-9]+"), GrammarSpec.choice(["yes", "no"])]
    states = [compiler.compile_sync(s).new_state() for s in specs * 3]
    assert states[0].accept(tokenizer.encode("4", add_special_tokens=False)[0])
    expected = allocate_bitmask(len(states), compiler.vocab_size)
    for row, state in enumerate(states):
        state.fill_bitmask(expected, row)
    filler = BitmaskFiller()
    try:
        pointers = []
        for _ in range(4):
            got = filler.submit(states).result()
            assert torch.equal(got, expected)
            pointers.append(got.data_ptr())
        assert pointers[0] == pointers[2] != pointers[1] == pointers[3]
        assert filler.submit(states[:2]).result().data_ptr() == pointers[0]
    finally:
        filler.shutdown()


def test_applier_masks_only_the_scattered_rows(compiler: GrammarCompiler) -> None:
    from genserve.worker.grammar_mask import BitmaskApplier

    bitmask = torch.zeros(2, (compiler.vocab_size + 31) // 32, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 1] = 1  # token 32
    apply = BitmaskApplier()
    for _ in range(2):  # the second call reuses the scatter buffer
        logits = torch.randn(5, compiler.vocab_size)
        original = logits.clone()
        apply(logits, bitmask, [3, 1])
        for row in (0, 2, 4):
            assert torch.equal(logits[row], original[row])
        assert torch.isfinite(logits[3]).nonzero().flatten().tolist() == [0, 2]
        assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [32]


def test_cpu_applier_equals_xgrammars_kernel_on_real_masks(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """The numpy-unpack CPU path gives exactly xgrammar's kernel's result, rows scattered."""
    import xgrammar as xgr

    from genserve.worker.grammar_mask import BitmaskApplier

    specs = [
        GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps({"type": "object"})),
        GrammarSpec(GrammarKind.REGEX, "[a-z ]+"),
        GrammarSpec.choice(["yes", "no"]),
    ]
    states = [compiler.compile_sync(s).new_state() for s in specs]
    assert states[0].accept(tokenizer.encode("{", add_special_tokens=False)[0])
    bitmask = allocate_bitmask(len(states), compiler.vocab_size)
    for row, state in enumerate(states):
        state.fill_bitmask(bitmask, row)
    rows = [4, 0, 2]
    logits = torch.randn(6, compiler.vocab_size)
    expected = logits.clone()
    for i, row in enumerate(rows):
        xgr.apply_token_bitmask_inplace(expected[row], bitmask[i])
    apply = BitmaskApplier()
    got = logits.clone()
    apply(got, bitmask, rows)
    assert torch.equal(got, expected)
    got = logits.clone()
    apply._apply_xgrammar(got, bitmask, rows)  # the CUDA path's logic, on CPU tensors
    assert torch.equal(got, expected)
    got, expected = logits[:3].clone(), logits[:3].clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    apply(got, bitmask, [0, 1, 2])  # every row constrained: no gather
    assert torch.equal(got, expected)


def test_importing_the_grammar_module_does_not_import_xgrammar() -> None:
    """The server imports this module and builds its compiler during the start; xgrammar's
    own import (0.4-0.8 s) belongs in the compile thread, after the start."""
    code = (
        "import sys\n"
        "import genserve.engine.grammar\n"
        "assert 'xgrammar' not in sys.modules, 'xgrammar was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
