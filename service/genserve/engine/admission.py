"""Which waiting requests join this step, and with how many tokens.  Pure Python.

Waiting requests are taken in the order the policy gave the queue, while the prefill budget,
``max_num_running``, ``max_loras_per_batch`` and free blocks allow, keeping free the blocks
the running requests are expected to grow into (the policy's growth estimate), so that
admissions are seldom undone by preemption.  The queue head blocks the rest (no
overtaking), except requests of an adapter that is cycled out (adapter_cycling.py), which
are passed over.  Each chosen request's KV slots (and prefix-cache hits) are allocated here;
the scheduler then starts them running.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from genserve.engine.prompt_fork import Wait, computed_prefix
from genserve.engine.request import Request
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.engine.scheduler_policy import AdmissionPolicy
from genserve.kv_cache.manager import KVCacheManager


@dataclass(slots=True)
class Admission:
    req: Request
    num_new_tokens: int
    num_cached_tokens: int


def choose_admissions(
    waiting: Iterable[Request],
    running: Sequence[Request],
    requests: dict[str, Request],
    kv: KVCacheManager,
    policy: AdmissionPolicy,
    config: SchedulerConfig,
    *,
    budget: int,
    num_slots: int,
    cycled_out: set[str],
    min_batch: int | None,
) -> list[Admission]:
    """The requests of ``waiting`` (in order) admitted into this step, their slots
    allocated; empty when fewer than ``min_batch`` would be (TGI: too small a batch is not
    worth pausing the running ones), their slots returned then."""
    reserve_tokens = sum(policy.growth_estimate(r) for r in running)
    admissions: list[Admission] = []
    adapters = {r.adapter.adapter_id for r in running if r.adapter is not None}
    for req in waiting:
        if len(admissions) >= num_slots or budget <= 0:
            break
        if req.adapter is not None and req.adapter.adapter_id in cycled_out:
            continue  # its turn is over while another adapter waits: let it drain
        if req.adapter is not None and req.adapter.adapter_id not in adapters:
            if config.max_loras_per_batch is not None and (
                len(adapters) >= config.max_loras_per_batch
            ):
                # Head-of-line, not skip-ahead: later requests of running adapters
                # would otherwise keep this adapter waiting forever.
                break
            adapters.add(req.adapter.adapter_id)
        prefix = computed_prefix(req, requests, kv)  # best_of / n forks
        if isinstance(prefix, Wait):
            break  # head of line: its leader's prompt is not computed yet
        computed_blocks, num_cached = prefix
        remaining = req.num_tokens - num_cached
        if config.chunked_prefill_enabled:
            num_new = min(remaining, config.max_chunk_tokens, budget)
        else:
            # Whole prompts.  One oversized prompt may still go alone in a step, or a
            # recomputation longer than the budget could never be readmitted.
            num_new = remaining
            if num_new > budget and budget < config.max_batch_prefill_tokens:
                break
        busy = bool(running) or bool(admissions)
        reserve = kv.num_blocks_for(math.ceil(reserve_tokens)) if busy else 0
        if kv.allocate_slots(req, num_new, computed_blocks, reserve) is None:
            break
        admissions.append(Admission(req, num_new, num_cached))
        budget -= num_new
        reserve_tokens += policy.growth_estimate(req)
    if min_batch is not None and len(admissions) < min_batch:
        for adm in admissions:
            kv.free(adm.req, keep_block_hashes=True)
        return []
    return admissions
