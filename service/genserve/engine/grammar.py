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
* :class:`BitmaskFiller` — the step's masks, as vLLM and SGLang compute them: every
  constrained row in one xgrammar batch call, in a worker thread started when the step is
  scheduled, so it runs while the model computes the step's forward pass (xgrammar releases
  the GIL); the runner waits for it only when it samples.  The buffer is reused.
* :func:`apply_bitmask` — the mask on the logits, word by word (see there).

Cost at 32 constrained rows on 2 CPU cores (SmolLM2 vocabulary, the benchmark's schema):
filling ~1-7 ms depending on the rows' states (in a string nearly every token is allowed,
and xgrammar then checks more of them), now run during the forward (which, on a 2-core
machine, already keeps both cores busy, so there it overlaps little); applying the mask
with xgrammar's CPU kernel ~7-11 ms, with :func:`apply_bitmask` ~1.5-2.5 ms.

Speculative decoding is turned off for constrained rows rather than checked against the
grammar: the scheduler gives a constrained request no draft tokens (``_speculative_chunk``),
because verifying k drafts would need k masks, each from the matcher advanced through the
drafts before it (and rolled back past the rejected ones).  Its output is therefore the same
with and without ``--speculate``; unconstrained rows in the batch are still drafted for.

The vocabulary is the model's logits width, which may exceed the tokenizer's (padding rows of
the embedding): xgrammar is told that size, and ids the tokenizer lacks are never allowed.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from genserve.engine.grammar_spec import GrammarError, GrammarKind, GrammarSpec, choice_ebnf

# Compiled grammars kept per server; a JSON schema's compiled form is typically tens of KB.
DEFAULT_CACHE_SIZE = 256


class CompiledGrammar:
    """A compiled grammar; opaque outside this module."""

    __slots__ = ("_compiled", "spec")

    def __init__(self, spec: GrammarSpec, compiled: Any) -> None:
        self.spec = spec
        self._compiled = compiled

    def new_state(self) -> GrammarState:
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

    @staticmethod
    def fill_batch(states: Sequence[GrammarState], bitmask: torch.Tensor) -> None:
        """Write ``states[i]``'s allowed next tokens into ``bitmask[i]``, all in one xgrammar
        call (its own threads; the GIL is released throughout)."""
        _batch_matcher().batch_fill_next_token_bitmask([s._matcher for s in states], bitmask)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its end (EOS) was accepted."""
        return bool(self._matcher.is_terminated())


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """A packed int32 bitmask ``[num_rows, ceil(vocab / 32)]`` (bit set: token allowed)."""
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


_BATCH_MATCHER: Any = None


def _batch_matcher() -> Any:
    """xgrammar's batch filler ("auto": half the hardware threads); stateless, shared."""
    global _BATCH_MATCHER
    if _BATCH_MATCHER is None:
        _BATCH_MATCHER = xgr.BatchGrammarMatcher("auto")
    return _BATCH_MATCHER


class PendingBitmask:
    """A step's bitmask being filled; :meth:`wait` returns it once complete."""

    __slots__ = ("_bitmask", "_future")

    def __init__(self, future: Future[None], bitmask: torch.Tensor) -> None:
        self._future = future
        self._bitmask = bitmask

    def wait(self) -> torch.Tensor:
        """The filled ``[rows, ceil(vocab / 32)]`` int32 bitmask (re-raises a fill error)."""
        self._future.result()
        return self._bitmask


class BitmaskFiller:
    """Fills each step's bitmask off the engine loop, overlapping the forward pass.

    One per scheduler.  The engine loop is sequential (schedule, run the step, update), so a
    step's matchers are not advanced, nor its buffer rows reused, before the runner has waited
    for the fill; the single worker thread keeps fills in step order even when a failed step
    was never waited for.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._buffer: torch.Tensor | None = None

    def start(self, states: Sequence[GrammarState]) -> PendingBitmask:
        """Begin filling row i of the step's bitmask for ``states[i]``."""
        vocab_size = states[0].vocab_size
        buffer = self._buffer
        if (
            buffer is None
            or buffer.shape[0] < len(states)
            or buffer.shape[1] != (vocab_size + 31) // 32
        ):
            buffer = allocate_bitmask(
                max(len(states), 2 * (0 if buffer is None else len(buffer))), vocab_size
            )
            self._buffer = buffer
        bitmask = buffer[: len(states)]
        fill = type(states[0]).fill_batch  # the states' class (tests record fills with a fake)
        return PendingBitmask(self._pool.submit(fill, list(states), bitmask), bitmask)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# Bit i of a packed word allows token 32 * word + i; bit 31 is the int32 sign bit.
_BITS = torch.tensor([1 << i for i in range(31)] + [-(1 << 31)], dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf in place, for ``rows`` of ``logits`` only
    (``bitmask[i]`` belongs to ``logits[rows[i]]``); other rows are not read or written.

    Word by word rather than bit by bit: a grammar's mask is almost all whole words (a word
    of 0 bits outside a string, of 1 bits inside one), so the 0 words blank their 32 logits
    in one broadcast ``masked_fill``, all-1 words need nothing, and only the few mixed words
    are unpacked.  xgrammar's CPU kernel tests every bit (~7-11 ms at 32 x 49152 on 2 cores
    against ~1.5-2.5 ms here); both give the same result, which the tests check."""
    vocab = logits.shape[1]
    if bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask covers {bitmask.shape[1] * 32} tokens, logits {vocab}")
    every_row = rows == list(range(logits.shape[0]))
    target = logits if every_row else logits[rows]  # a copy of the constrained rows
    num_rows = target.shape[0]
    whole = vocab // 32  # words entirely inside the logits
    words = bitmask[:num_rows, :whole]
    blocks = target[:, : whole * 32].view(num_rows, whole, 32)
    blocks.masked_fill_((words == 0).unsqueeze(-1), float("-inf"))
    mixed = ((words != 0) & (words != -1)).nonzero()
    if len(mixed):
        r, w = mixed[:, 0], mixed[:, 1]
        banned = (words[r, w].unsqueeze(-1) & _BITS) == 0  # [mixed, 32]
        blocks[r, w] = blocks[r, w].masked_fill(banned, float("-inf"))
    if whole * 32 < vocab:  # a partial last word
        tail = vocab - whole * 32
        banned = (bitmask[:num_rows, whole].unsqueeze(-1) & _BITS[:tail]) == 0
        target[:, whole * 32 :].masked_fill_(banned, float("-inf"))
    if not every_row:
        logits[rows] = target


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
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        # xgrammar's own cache is off: ours is bounded by entries and keyed by the spec.
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")

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
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.compile_sync, spec)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: GrammarSpec) -> Any:
        try:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                json.loads(spec.text)  # a clear message for text that is not JSON at all
                return self._compiler.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind is GrammarKind.JSON_OBJECT:
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False
                )
            if spec.kind is GrammarKind.REGEX:
                return self._compiler.compile_regex(spec.text)
            if spec.kind is GrammarKind.EBNF:
                return self._compiler.compile_grammar(spec.text)
            values = json.loads(spec.text)
            return self._compiler.compile_grammar(choice_ebnf(values))
        except json.JSONDecodeError as exc:
            raise GrammarError(f"grammar.{spec.kind.value} is not valid JSON: {exc}") from None
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _LOG_PREFIX.sub("", str(exc)).strip()
            raise GrammarError(f"invalid grammar.{spec.kind.value}: {message}") from None


# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: ", noise to a client.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
