"""A step the runner has launched but not yet collected (overlapped scheduling, issue #29).

``ModelRunner.launch`` queues a step's work on the device — inputs, forward, sampling, the
one readback copy — and returns a :class:`LaunchedStep`; ``ModelRunner.collect`` waits for
that readback and turns it into the step's :class:`~genserve.step.RunnerOutput`.  Between
the two the step thread may launch the next step, whose placeholder tokens are read on the
device from :attr:`LaunchedStep.pending`'s ids, so the device never waits for the host's
per-step Python (vLLM v1's ``AsyncModelRunnerOutput``; SGLang's overlap loop resolves its
future map on the device the same way).

What the next launch may read of the host state and what only :meth:`collect` writes:

* Known without the tokens' values, written at launch: each one-token chunk's output and
  token counts (+1), its sampling row (the placeholder's source), the penalty counts (from
  the device ids) and the slots' output counts.
* Known only from the values, written at collect: the tokens themselves, each request's
  last token on the host (the watermark's previous token, the host fallback of a
  placeholder), and everything about speculative chunks (how many drafts were kept).
  A launch that needs one of these collects the uncollected step first
  (``ModelRunner._needs_values``): it runs serially, with the same outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from genserve.step import PromptLogprobs, RunnerOutput, ScheduledChunk
from genserve.worker.request_state import RequestState
from genserve.worker.sampler import PendingSamples


@dataclass(slots=True)
class LaunchedStep:
    """One launched step.  ``output`` is set once collected (at once for a step that samples
    nothing); until then ``pending`` holds its queued samples, for ``chunks`` (the sampling
    chunks, in row order) and ``states`` (their requests' state objects, kept even if the
    request is forgotten before the collect)."""

    step_id: int
    output: RunnerOutput | None = None
    pending: PendingSamples | None = None
    chunks: list[ScheduledChunk] = field(default_factory=list)
    states: list[RequestState] = field(default_factory=list)
    prompt: tuple[PromptLogprobs, ...] = ()
    speculative: bool = False  # counts and the next placeholders' rows come at collect


def advance_counts(chunks: list[ScheduledChunk], states: list[RequestState]) -> dict[str, int]:
    """At launch, for a step without draft tokens: one more output token for every chunk
    (whatever its value), and the row of each chunk's token, where the next step's
    placeholder reads it."""
    rows: dict[str, int] = {}
    for row, (c, state) in enumerate(zip(chunks, states, strict=True)):
        state.num_output_tokens += 1
        state.num_tokens += 1
        rows[c.req_id] = row
    return rows
