"""Admission policy: who is admitted first, when a new batch may join, how much KV headroom
to keep.  The scheduler owns the mechanics (queues, blocks, preemption); this module owns the
judgement calls and their state.  Pure Python; no torch.
"""

from __future__ import annotations

import math
from collections import deque

from genserve.engine.request import FinishReason, Request
from genserve.engine.scheduler_config import SchedulePolicy, SchedulerConfig
from genserve.kv_cache.manager import KVCacheManager

# Learned headroom (SchedulerConfig.growth_reserve_ratio is None): the starting guess, and
# the weight of each finished request in the running mean.
INITIAL_GROWTH_RATIO = 0.5
GROWTH_RATIO_EMA = 0.05


class AdmissionPolicy:
    """State and rules behind admissions; one per scheduler."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # TGI's "waiting tokens": steps since the last admission, plus one.
        self._waiting_tokens = 1
        ratio = config.growth_reserve_ratio
        self.growth_ratio = INITIAL_GROWTH_RATIO if ratio is None else ratio

    # ---- order ----------------------------------------------------------------------------

    def order_waiting(self, waiting: deque[Request], kv: KVCacheManager) -> deque[Request]:
        """The waiting queue in admission order.  fcfs: as queued (arrivals at the back,
        preempted requests at the front).  lpm: longest cached prefix first, ties in queue
        order; fcfs once the queue is longer than ``lpm_max_queue_len`` (SGLang's rule)."""
        cfg = self.config
        if cfg.policy is not SchedulePolicy.LPM or not 1 < len(waiting) <= cfg.lpm_max_queue_len:
            return waiting
        cached = {r.req_id: kv.peek_num_cached_tokens(r) for r in waiting}
        return deque(sorted(waiting, key=lambda r: -cached[r.req_id]))

    # ---- TGI's batching rule (chunked prefill disabled) -----------------------------------

    def min_new_batch(self, num_running: int) -> int | None:
        """How many requests a new prefill batch must hold to join ``num_running`` running
        ones, or None for "any number".  Always None with chunked prefill, unless
        ``batch_arrivals`` asks for TGI's rule there too.

        TGI: with a batch running, a new batch needs ``floor(num_running *
        waiting_served_ratio)`` requests, unless ``max_waiting_tokens`` steps passed since the
        last prefill (then any size will do).
        """
        cfg = self.config
        if (cfg.chunked_prefill_enabled and not cfg.batch_arrivals) or not num_running:
            return None
        if self._waiting_tokens >= cfg.max_waiting_tokens:
            return None
        return math.floor(num_running * cfg.waiting_served_ratio)

    def on_step(self, had_running: bool, admitted: bool) -> None:
        """Count steps as TGI counts "waiting tokens"."""
        if admitted:
            # TGI prefills a batch joining a running one and then decodes the merged batch in
            # the same iteration (ours: one step), which counts once.
            self._waiting_tokens = 2 if had_running else 1
        elif had_running:
            self._waiting_tokens += 1

    # ---- KV headroom ----------------------------------------------------------------------

    def growth_estimate(self, req: Request) -> float:
        """Tokens ``req`` is expected to add to the cache before it ends."""
        left = req.stopping.max_new_tokens - req.num_output_tokens
        return min(left, self.config.growth_reserve_max_tokens) * self.growth_ratio

    def on_finish(self, req: Request, reason: FinishReason) -> None:
        """Learn from requests that ended on their own; cancellations say nothing about
        how long requests get."""
        natural = reason in (
            FinishReason.LENGTH,
            FinishReason.EOS_TOKEN,
            FinishReason.STOP_SEQUENCE,
        )
        if self.config.growth_reserve_ratio is None and natural:
            used = req.num_output_tokens / req.stopping.max_new_tokens
            self.growth_ratio += GROWTH_RATIO_EMA * (used - self.growth_ratio)
