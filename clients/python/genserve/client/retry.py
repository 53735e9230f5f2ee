"""Retrying calls that failed with UNAVAILABLE (server loading, restarting, or unreachable)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: attempt n (from 1) that fails with a code in ``retry_codes`` is
    followed, after ``min(max_backoff_s, initial_backoff_s * multiplier**(n-1))`` seconds times a
    random factor in [1 - jitter, 1], by attempt n + 1, up to ``max_attempts`` attempts and never
    past the call's timeout.  A stream is retried only while it has produced no message, so a
    caller never sees tokens twice.  RESOURCE_EXHAUSTED is not retried by default: overload is
    the caller's decision to make.  ``RetryPolicy(max_attempts=1)`` disables retries."""

    max_attempts: int = 5
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_codes: frozenset[grpc.StatusCode] = field(
        default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE})
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("jitter must be in [0, 1]")

    def backoff_s(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (from 1)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return base * (1.0 - self.jitter * random.random())

    def should_retry(
        self, code: grpc.StatusCode, attempt: int, delay_s: float, remaining_s: float | None
    ) -> bool:
        """Whether failed attempt ``attempt`` with ``code`` gets another try after ``delay_s``,
        given ``remaining_s`` of the call's timeout (None: no timeout)."""
        if code not in self.retry_codes or attempt >= self.max_attempts:
            return False
        return remaining_s is None or delay_s < remaining_s


NO_RETRY = RetryPolicy(max_attempts=1)
