"""The contract between the scheduler (rank 0, pure Python) and the model runner.

The scheduler describes one engine step as a :class:`SchedulerOutput`; the runner executes it
and answers with a :class:`RunnerOutput`.  The runner never sees a request object: everything
it needs travels in these messages, which is also what is broadcast to tensor-parallel shard
workers.  This module imports nothing from the project (and no torch) so that both sides, and
their tests, can depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen.  Defaults mean "off"; ``temperature == 0`` is greedy.

    Validation happens before a request reaches the engine; these values are trusted here.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # 1.0: no nucleus filtering
    typical_p: float = 1.0  # 1.0: no typical filtering
    repetition_penalty: float = 1.0  # 1.0: none (HF/TGI semantics, over prompt + output)
    frequency_penalty: float = 0.0  # 0.0: none (TGI semantics, over prompt + output)
    seed: int = 0  # always set for sampled requests (the engine draws one when absent)
    num_top_tokens: int = 0  # alternatives to return per sampled position
    prompt_logprobs: bool = False  # compute logprobs of the prompt tokens too
    # 0.0: none (OpenAI/vLLM semantics: once per distinct token of the output, not the prompt)
    presence_penalty: float = 0.0
    # 0.0: none (OpenAI/vLLM frequency_penalty, issue #27: penalty x count over the output).
    # Only rank 0 samples, so shard messages do not carry it.
    output_frequency_penalty: float = 0.0
    # Issue #15 logits controls (worker/logits_processors.py).  Only rank 0 samples, so shard
    # messages do not carry them.
    min_p: float = 0.0  # 0.0: none (transformers' MinPLogitsWarper)
    min_new_tokens: int = 0  # while fewer tokens were generated, ``min_tokens_banned_ids``
    min_tokens_banned_ids: tuple[int, ...] = ()  # are masked (EOS and stop_token_ids)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits
    # Issue #15 watermark (worker/watermark.py): delta added to the green list's logits;
    # gamma/delta are the server's --watermark-gamma/--watermark-delta.
    watermark: bool = False
    watermark_gamma: float = 0.5
    watermark_delta: float = 2.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Whether the logits depend on the tokens so far (such rows never take drafts)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.output_frequency_penalty != 0.0
        )


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """The LoRA adapter a request uses: ``adapter_id`` read from ``path`` (a PEFT
    directory), held in the runner's LoRA slot ``slot`` (the scheduler assigns slots)."""

    slot: int
    adapter_id: str
    path: str


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Sent once when a request is (re)admitted: after preemption it is sent again.

    ``all_token_ids`` is the prompt followed by every token generated so far; the runner
    seeds its penalty state from it and, for prompt logprobs, reads targets from it.
    """

    req_id: str
    all_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    sampling: SamplingParams
    adapter: AdapterRef | None = None  # None: the base model


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens of one request whose KV the runner computes this step.

    ``token_ids`` sit at positions ``start_pos .. start_pos + len(token_ids) - 1``.  The KV of
    positions below ``start_pos`` is already in the blocks of ``block_ids`` (computed earlier or
    taken from the prefix cache).  ``block_ids`` is the request's whole block table, long enough
    for every position computed this step.  When ``sample`` is true the chunk reaches the end of
    the known sequence and the runner samples one new token for it.

    Speculative decoding: the last ``num_draft_tokens`` entries of ``token_ids`` are proposed
    continuations of the sequence, not accepted tokens (the chunk then starts with the last
    known token and has ``sample`` set).  The runner samples after every position and keeps a
    draft only while it equals what was sampled before it, so it returns 1 to
    ``num_draft_tokens + 1`` tokens for the chunk: exactly those one-token steps would have
    produced.

    Overlapped scheduling (issue #29): with ``token_from_last_step`` the chunk is one decode
    token scheduled before the step that samples it had returned.  Its ``token_ids[0]`` is a
    placeholder (0): the runner takes the token it sampled for ``req_id`` in the previous
    step, from the device, without a round trip through the host.  Only runners that say
    ``supports_token_from_last_step`` are given such chunks.
    """

    req_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_ids: tuple[int, ...]
    sample: bool
    num_draft_tokens: int = 0
    token_from_last_step: bool = False

    @property
    def is_decode(self) -> bool:
        """Every token sits at the end of the known sequence (one decode token, or the last
        token and its drafts): each is attended as a decode row of its own."""
        return len(self.token_ids) == 1 or self.num_draft_tokens > 0


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One engine step.  The runner applies ``finished_req_ids`` first (dropping per-request
    state of finished, aborted and preempted requests), then registers ``new_requests``, then
    computes ``chunks`` in one forward pass.  Decode chunks (one token) and prefill chunks may
    be mixed freely."""

    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    finished_req_ids: tuple[str, ...] = ()
    # Structured output: an int32 packed token bitmask (a torch tensor or, from the scheduler,
    # an engine.grammar.PendingBitmask still being filled; xgrammar's layout
    # ``[len(grammar_req_ids), ceil(vocab / 32)]``), row i for the sampling chunk of
    # ``grammar_req_ids[i]``.  Only rank 0 samples, so shard messages do not carry it.
    grammar_bitmask: object | None = None
    grammar_req_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The token sampled for one chunk with ``sample=True``, with its logprob under the
    unmodified (pre-temperature, pre-penalty) distribution and the top alternatives."""

    req_id: str
    token_id: int
    logprob: float
    top_tokens: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Logprobs of prompt tokens at positions ``first_pos .. first_pos + len(logprobs) - 1``,
    each conditioned on the tokens before it.  Position 0 never has one."""

    req_id: str
    first_pos: int
    logprobs: tuple[TokenLogprob, ...]
    # Issue #27: with num_top_tokens, the most likely tokens at each of those positions.
    top: tuple[tuple[TokenLogprob, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """``sampled`` holds one token per sampling chunk, in chunk order; a chunk with drafts
    has one entry per accepted draft plus the token sampled after them, consecutive and in
    sequence order."""

    step_id: int
    sampled: tuple[SampledToken, ...] = ()
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the paged KV cache the runner allocated (reported to the scheduler)."""

    num_blocks: int
    block_size: int
    bytes_per_block: int = 0
    extra: dict[str, str] = field(default_factory=dict)


class Runner(Protocol):
    """What the engine drives.  Implemented by the model runner (and by test doubles)."""

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        """Run one step.  Blocking; the engine calls it from one worker thread at a time."""
        ...

    def shutdown(self) -> None:
        """Release devices, stop shard workers.  Idempotent."""
        ...
