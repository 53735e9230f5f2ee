"""What one benchmark run measured: per-request timings, the same for every system.

genserve runs (over gRPC) and the Hugging Face baselines (in process) produce the same
:class:`RequestRecord` and :class:`RunResult`, so one summary code path (``report.py``) turns
all of them into comparable numbers.  Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request from submission to its last token.

    ``token_times`` holds the moment each generated token became visible to the client (for
    genserve: arrival of its stream message; for the baselines: the end of the step that
    produced it), so ``token_times[0] - start`` is the time to first token.
    ``num_generated_tokens`` is what was actually produced (an early end-of-sequence token
    makes it smaller than the requested ``max_new_tokens``).  ``error`` is set, and the
    timings are partial, when the request failed.
    """

    prompt_id: int
    start: float
    end: float
    token_times: tuple[float, ...]
    num_generated_tokens: int
    max_new_tokens: int
    input_length: int
    finish_reason: str = ""
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        """Seconds from submission to the first generated token; None when none came."""
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def e2e(self) -> float:
        """Seconds from submission to the end of the request."""
        return self.end - self.start

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive generated tokens (empty with fewer than two)."""
        times = self.token_times
        return [later - earlier for earlier, later in itertools.pairwise(times)]

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first token; None with fewer than two tokens."""
        if len(self.token_times) < 2:
            return None
        span = self.token_times[-1] - self.token_times[0]
        return (len(self.token_times) - 1) / span if span > 0 else None


@dataclass(frozen=True, slots=True)
class RunResult:
    """All requests of one configuration: a genserve concurrency level, a baseline batch size,
    or a phase of the prefix scenario.

    ``system`` names what ran (``"genserve"``, ``"hf_generate"``, ``"hf_generate_batch"``),
    ``concurrency`` is the number of streams (genserve) or the batch size (baselines).
    ``wall_s`` is the span during which the measured requests were in flight: throughput is
    generated tokens over it.  ``notes`` carries anything a reader needs to interpret the
    numbers (setup time excluded, early EOS, ...).  ``steady_window`` (genserve levels with
    staggered streams) is the span during which all streams had a request in flight: the
    steady-state throughput and the "joining a running batch" TTFT are measured inside it.
    """

    name: str
    system: str
    concurrency: int
    records: tuple[RequestRecord, ...]
    wall_s: float
    notes: tuple[str, ...] = field(default=())
    steady_window: tuple[float, float] | None = None
