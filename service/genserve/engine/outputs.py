"""What the engine receives per request and what it streams back to the servicer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from genserve.engine.request import FinishReason, Request, StoppingCriteria
from genserve.step import AdapterRef, SamplingParams

if TYPE_CHECKING:
    from genserve.engine.grammar import CompiledGrammar, GrammarState


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated request, ready for the engine (tokenized, limits checked, seed drawn)."""

    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingCriteria
    stop: tuple[str, ...] = ()
    seed: int | None = None  # reported back in details; None for greedy requests
    grammar: CompiledGrammar | None = None  # structured output (compiled before queueing)
    adapter_id: str | None = None  # LoRA adapter asked for; None: the server's default
    skip_special_tokens: bool = True  # leave special tokens out of the text
    include_stop_str_in_output: bool = False  # keep the stop string / stop token's text
    fork_of: str | None = None  # best_of / n follower: shares this request's prompt KV


def scheduler_request(
    req: GenerationRequest,
    adapter: AdapterRef | None = None,
    grammar: GrammarState | None = None,
) -> Request:
    """The scheduler's request for ``req``, under ``adapter`` and with ``grammar``'s fresh
    state: what the in-process engine adds, what the engine process adds from an ADD message
    and what the ``--engine-process`` front checks against the KV capacity."""
    return Request(
        req_id=req.req_id,
        prompt_token_ids=list(req.prompt_token_ids),
        sampling=req.sampling,
        stopping=req.stopping,
        grammar=grammar,
        # The adapter is part of every block hash: the same prompt under two adapters
        # never shares KV.
        cache_salt=f"lora:{adapter.adapter_id}" if adapter else None,
        adapter=adapter,
        fork_of=req.fork_of,
    )


# TokenInfo and TokenOutput are not frozen: the engine thread makes one of each per generated
# token, and a frozen dataclass's __init__ (object.__setattr__ per field) costs about four
# times as much.  Nothing changes them after they are made; treat them as immutable.
@dataclass(slots=True)
class TokenInfo:
    token_id: int
    text: str
    logprob: float | None
    special: bool


@dataclass(frozen=True, slots=True)
class FinalInfo:
    """Sent with the last token of a request."""

    finish_reason: FinishReason
    generated_text: str
    num_generated_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    prefill: tuple[TokenInfo, ...] = ()  # when prompt logprobs were asked for
    # Issue #27: top alternatives per prompt position, with prompt logprobs and top tokens.
    prefill_top: tuple[tuple[TokenInfo, ...], ...] = ()
    error: str | None = None  # set when finish_reason is ERROR or ABORTED


@dataclass(slots=True)
class TokenOutput:
    """One generated token (``token`` may be None only on an ended-without-token message).

    ``token.text`` is the text this token made final; the texts of all messages of a request
    concatenate to exactly ``final.generated_text``."""

    index: int
    token: TokenInfo | None
    top_tokens: tuple[TokenInfo, ...] = ()
    final: FinalInfo | None = None
