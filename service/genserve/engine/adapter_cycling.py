"""LoRAX's ``--adapter-cycle-time-s``: which adapters stop taking new requests so that one
kept out by ``--max-loras-per-batch`` gets its turn.  Pure Python.

When ``max_loras_per_batch`` is reached and requests of another adapter are kept out by
it, each adapter that has been running for longer than the cycle time (oldest first, at
most one per adapter kept out) *yields*: it takes no new requests, its running ones finish,
and its place goes to a waiting adapter.  It keeps yielding until no adapter is kept out
any more (every one that waited got in), then queues again like any other; its clock
restarts when it runs again.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from genserve.engine.request import Request
from genserve.engine.scheduler_config import SchedulerConfig

log = structlog.get_logger("genserve.engine.scheduler")


class AdapterCycler:
    """The scheduler's record of when each running adapter joined the running set."""

    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._active_since: dict[str, float] = {}
        self._yielding: set[str] = set()

    def cycled_out(self, running: set[str], waiting: Iterable[Request], now: float) -> set[str]:
        """The adapters whose waiting requests admission skips this step; ``running``: the
        adapter ids of the running requests."""
        since = self._active_since
        for adapter_id in list(since):
            if adapter_id not in running:
                del since[adapter_id]
        for adapter_id in running:
            since.setdefault(adapter_id, now)
        yielding = self._yielding
        cap = self._config.max_loras_per_batch
        kept_out = {
            r.adapter.adapter_id
            for r in waiting
            if r.adapter is not None
            and r.adapter.adapter_id not in running
            and r.adapter.adapter_id not in yielding
        }
        if cap is None or not kept_out:
            yielding.clear()
            return yielding
        if len(running) >= cap:
            budget = len(kept_out) - len(yielding & running)
            expired = sorted(
                (t, adapter_id)
                for adapter_id, t in since.items()
                if adapter_id not in yielding and now - t >= self._config.adapter_cycle_time_s
            )
            for _, adapter_id in expired[: max(0, budget)]:
                log.info(
                    "adapter_cycled_out", adapter_id=adapter_id, active_s=now - since[adapter_id]
                )
                yielding.add(adapter_id)
        return yielding
