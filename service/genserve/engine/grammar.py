"""Grammar-constrained decoding (structured output) on xgrammar.

This is the only module that imports xgrammar.  Three parts:

* :class:`~genserve.engine.grammar_spec.GrammarSpec` (what the client asked for) is defined
  apart, without xgrammar or torch, so the server can parse requests before the model loads.
* :class:`GrammarCompiler` — compiles specs against the model's vocabulary in a thread pool
  (never on the event loop) and keeps the compiled grammars in a bounded LRU keyed by the
  spec's text, so a schema sent with every request compiles once.  A bad schema, regex or
  grammar raises :class:`GrammarError` with xgrammar's message, before the request is queued.
* :class:`GrammarState` — one request's matcher.  It lives on the engine's request object
  (rank 0), is advanced with each token the scheduler keeps, and fills that request's row of
  the step's packed bitmask.  A preempted request keeps its output tokens and so its matcher:
  recomputing the KV changes nothing the grammar has seen.
* :class:`BitmaskFiller` — a step's masks, filled for all its constrained rows in one batched
  call while the forward runs; the worker applies them to those rows only
  (:class:`genserve.worker.grammar_mask.BitmaskApplier`).

Speculative decoding: constrained rows get no draft tokens (the scheduler turns speculation
off for them, ``Scheduler._speculative_chunk``); drafts are not checked against the grammar.

The vocabulary is the model's logits width, which may exceed the tokenizer's (padding rows of
the embedding): xgrammar is told that size, and ids the tokenizer lacks are never allowed.

xgrammar is imported inside the functions that call it, not with this module: its import
takes 0.4-0.8 s on a 2-vCPU machine (its tokenizer module imports transformers' tokenizer
and chat-template machinery), and the server builds its :class:`GrammarCompiler` at start.
So the first import happens in the compile thread, with the vocabulary, after the start.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from genserve.engine.grammar_spec import (
    GrammarError,
    GrammarKind,
    GrammarSpec,
    ReasoningGate,
    choice_ebnf,
)

# Compiled grammars kept per server; a JSON schema's compiled form is typically tens of KB.
DEFAULT_CACHE_SIZE = 256


class CompiledGrammar:
    """A compiled grammar; opaque outside this module."""

    __slots__ = ("_compiled", "spec")

    def __init__(self, spec: GrammarSpec, compiled: Any) -> None:
        self.spec = spec
        self._compiled = compiled

    def new_state(self) -> GrammarState:
        import xgrammar as xgr  # lazy: see the module docstring

        return GrammarState(
            xgr.GrammarMatcher(self._compiled), self._compiled.tokenizer_info.vocab_size
        )


class GrammarState:
    """One request's position in its grammar."""

    __slots__ = ("_matcher", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar does not allow it (state kept)."""
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (EOS) was accepted."""
        return bool(self._matcher.is_terminated())


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A packed int32 bitmask ``[num_rows, ceil(vocab / 32)]`` (bit set: token allowed)."""
    import xgrammar as xgr  # lazy: see the module docstring

    return xgr.allocate_token_bitmask(num_rows, vocab_size)


class PendingBitmask:
    """A step's bitmask being filled in the grammar thread while the model's forward runs
    (torch and xgrammar both release the GIL); :meth:`result` waits for it.  vLLM and SGLang
    overlap the mask with the forward the same way."""

    __slots__ = ("_future",)

    def __init__(self, future: Future[torch.Tensor]) -> None:
        self._future = future

    def result(self) -> torch.Tensor:
        return self._future.result()


class BitmaskFiller:
    """Fills the bitmask rows of all constrained requests of a step in one xgrammar call
    (``BatchGrammarMatcher``: C++, its own threads), off the engine loop, into buffers
    allocated once and reused (two, alternating: the runner may still read step N's
    while step N+1's is being filled)."""

    def __init__(self, max_threads: int = 2) -> None:
        import xgrammar as xgr  # lazy: see the module docstring

        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")

    def submit(self, states: list[GrammarState]) -> PendingBitmask:
        """Start filling ``states``' rows (row i for ``states[i]``); the states must not
        accept tokens until :meth:`PendingBitmask.result` returned."""
        buffer = self._buffer(len(states), states[0].vocab_size)
        matchers = [s._matcher for s in states]
        return PendingBitmask(self._pool.submit(self._fill, matchers, buffer))

    def _fill(self, matchers: list[Any], buffer: torch.Tensor) -> torch.Tensor:
        self._batch.batch_fill_next_token_bitmask(matchers, buffer)
        return buffer

    def _buffer(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        self._next ^= 1
        if len(self._buffers) < 2:
            self._buffers = [allocate_bitmask(num_rows, vocab_size) for _ in range(2)]
        buffer = self._buffers[self._next]
        if buffer.shape[0] < num_rows or buffer.shape[1] * 32 < vocab_size:
            # Grow to the next power of two, so a growing batch reallocates log(n) times.
            rows = 1 << (num_rows - 1).bit_length()
            buffer = self._buffers[self._next] = allocate_bitmask(rows, vocab_size)
        return buffer[:num_rows]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer and vocabulary width."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_threads: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        # Told of each spec about to be compiled (not of cache hits): --engine-process's
        # front has the engine process start its own compile of it at the same time.
        self.on_compile: Callable[[GrammarSpec], None] | None = None
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        # The vocabulary's xgrammar form is built in the compile thread, not in the start:
        # it walks every token (0.25 s at a 49k vocabulary, more at Llama-3's 128k) and no
        # request needs it before its first grammar, which queues behind it in that thread.
        self._compiler_future = self._pool.submit(
            _make_compiler, hf_tokenizer, vocab_size, sorted(stop_token_ids), max_threads
        )

    def compile_sync(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (or take from the cache); raises :class:`GrammarError`."""
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            return cached
        compiled = CompiledGrammar(spec, self._compile(spec))
        self._cache[spec] = compiled
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """:meth:`compile_sync` in the compile thread (a cache hit returns at once)."""
        cached = self._cache.get(spec)
        if cached is not None:
            self._cache.move_to_end(spec)
            return cached
        if self.on_compile is not None:
            self.on_compile(spec)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.compile_sync, spec)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        compiler = self._compiler_future.result()
        try:
            if spec.reasoning is not None:
                return compiler.compile_structural_tag(
                    after_reasoning(spec.reasoning, str(_grammar(spec)))
                )
            return compiler.compile_grammar(_grammar(spec))
        except json.JSONDecodeError as exc:
            raise GrammarError(f"grammar.{spec.kind.value} is not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _LOG_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(f"invalid grammar.{spec.kind.value}: {message}") from None


def _make_compiler(
    hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int
) -> Any:
    import xgrammar as xgr  # lazy, in the compile thread: see the module docstring

    info = xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    # xgrammar's own cache is off: ours is bounded by entries and keyed by the spec.
    return xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)


def _grammar(spec: GrammarSpec) -> Any:
    """The grammar ``spec`` asks for, not yet compiled (raises as :meth:`_compile` catches)."""
    import xgrammar as xgr  # lazy: see the module docstring

    if spec.kind is GrammarKind.JSON_SCHEMA:
        json.loads(spec.text)  # a clear message for text that is not JSON at all
        return xgr.Grammar.from_json_schema(spec.text, any_whitespace=False)
    if spec.kind is GrammarKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if spec.kind is GrammarKind.REGEX:
        return xgr.Grammar.from_regex(spec.text)
    if spec.kind is GrammarKind.EBNF:
        return xgr.Grammar.from_ebnf(spec.text)
    return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.text)))


def after_reasoning(gate: ReasoningGate, ebnf: str) -> str:
    """An xgrammar structural tag (JSON): free text in the reasoning section, then ``ebnf``.

    This is how vLLM and SGLang combine reasoning with structured output (the grammar is
    enabled once the reasoning ends), done inside one grammar: the reasoning is xgrammar's
    ``any_text`` up to the close tag, so the matcher follows the text across token
    boundaries and a tag split over several tokens is still seen."""
    constrained: dict[str, Any] = {"type": "grammar", "grammar": ebnf}
    newlines: dict[str, Any] = {"type": "regex", "pattern": "\\n{0,2}"}
    thought: dict[str, Any] = {
        "type": "tag",
        "begin": "" if gate.starts_inside else gate.open_tag,
        "content": {"type": "any_text"},
        "end": gate.close_tag,
    }
    reasoned: dict[str, Any] = {"type": "sequence", "elements": [thought, newlines, constrained]}
    fmt = reasoned if gate.starts_inside else {"type": "or", "elements": [reasoned, constrained]}
    return json.dumps({"type": "structural_tag", "format": fmt})


# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: ", noise to a client.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
