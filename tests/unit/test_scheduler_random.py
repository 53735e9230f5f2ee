"""Randomized: thousands of steps of arrivals, cancellations, stop strings and finishes.

The fake runner checks every KV read through the block tables; the harness checks the
scheduler's and the block pool's invariants after every step (ref counts equal owners, free
+ used = total, queues consistent).  At the end every request has ended exactly once, every
request that was not cancelled produced exactly the tokens it produces with no memory
pressure at all, and every block is free.
"""

from __future__ import annotations

import itertools
import random

import pytest
from scheduler_fakes import VOCAB_SIZE, Harness, reference_output

from genserve.engine.request import FinishReason
from genserve.engine.scheduler_config import SchedulePolicy, SchedulerConfig

CONFIGS = {
    # Tiny caches: constant preemption.
    "tiny-chunked": SchedulerConfig(
        num_blocks=12, block_size=4, max_batch_prefill_tokens=16, chunked_prefill_size=8
    ),
    "tiny-tgi": SchedulerConfig(
        num_blocks=12,
        block_size=4,
        max_batch_prefill_tokens=16,
        chunked_prefill_enabled=False,
        max_waiting_tokens=3,
    ),
    # --prefill-batching: TGI's rule with chunked prefill (on where CUDA graphs run).
    "tiny-chunked-batched": SchedulerConfig(
        num_blocks=12,
        block_size=4,
        max_batch_prefill_tokens=16,
        chunked_prefill_size=8,
        batch_arrivals=True,
        max_waiting_tokens=3,
    ),
    "tiny-lpm": SchedulerConfig(
        num_blocks=16, block_size=4, max_batch_prefill_tokens=24, policy=SchedulePolicy.LPM
    ),
    "tiny-no-prefix-cache": SchedulerConfig(
        num_blocks=12, block_size=4, max_batch_prefill_tokens=16, enable_prefix_caching=False
    ),
    "block-size-1": SchedulerConfig(num_blocks=48, block_size=1, max_batch_prefill_tokens=20),
    "big-blocks": SchedulerConfig(
        num_blocks=6, block_size=16, max_batch_prefill_tokens=32, chunked_prefill_size=12
    ),
    "reserve-and-cap": SchedulerConfig(
        num_blocks=16,
        block_size=4,
        max_batch_prefill_tokens=16,
        max_num_running=4,
        growth_reserve_ratio=0.5,
    ),
    "tgi-lpm-cap": SchedulerConfig(
        num_blocks=20,
        block_size=4,
        max_batch_prefill_tokens=16,
        chunked_prefill_enabled=False,
        policy=SchedulePolicy.LPM,
        max_num_running=5,
        waiting_served_ratio=0.5,
    ),
    # Ample cache: no pressure (the reference conditions, through the scheduler).
    "ample": SchedulerConfig(num_blocks=1024, block_size=4, max_batch_prefill_tokens=64),
    # Speculative decoding against a fake model whose output loops (drafts often land):
    # under preemption pressure, and with room to speak of.
    "spec-tiny": SchedulerConfig(
        num_blocks=16,
        block_size=4,
        max_batch_prefill_tokens=16,
        num_speculative_tokens=3,
        speculate_max_batch_size=8,
    ),
    "spec-ample": SchedulerConfig(
        num_blocks=1024,
        block_size=4,
        max_batch_prefill_tokens=64,
        num_speculative_tokens=5,
        speculate_max_batch_size=64,
    ),
}
PRESSURED = {
    "tiny-chunked",
    "tiny-tgi",
    "tiny-lpm",
    "tiny-no-prefix-cache",
    "big-blocks",
    "spec-tiny",
}
NUM_STEPS = 1500


@pytest.mark.parametrize("ahead", [False, True], ids=["serial", "ahead"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_workload_keeps_invariants_and_exact_outputs(name: str, ahead: bool) -> None:
    """``ahead``: steps are scheduled before the previous step's results are applied
    (overlapped scheduling, issue #29), wherever the scheduler allows."""
    config = CONFIGS[name]
    rng = random.Random(f"genserve-{name}")
    repetitive = config.num_speculative_tokens > 0
    h = Harness(config, repetitive=repetitive, ahead=ahead)
    capacity = config.max_batch_total_tokens
    # A few shared prefixes so that the prefix cache gets hits (and evictions).
    prefixes = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(4, 20))] for _ in range(4)]
    eos_of: dict[str, frozenset[int]] = {}
    ignore_eos_of: dict[str, bool] = {}
    num_added = 0

    def unfinished() -> list[str]:
        return [r for r in h.reqs if r not in h.ends]

    for _ in range(NUM_STEPS):
        if rng.random() < 0.3:
            for _ in range(rng.randint(1, 3)):
                req_id = f"r{num_added}"
                num_added += 1
                max_new = rng.randint(1, min(24, capacity // 3))
                prompt = list(rng.choice(prefixes)) if rng.random() < 0.5 else []
                prompt += [rng.randrange(VOCAB_SIZE) for _ in range(rng.randint(0, 20))]
                prompt = (prompt or [1])[: capacity - max_new]
                eos_of[req_id] = frozenset({rng.randrange(VOCAB_SIZE)})
                ignore_eos_of[req_id] = rng.random() < 0.2
                h.add(
                    req_id,
                    prompt,
                    max_new,
                    eos_token_ids=eos_of[req_id],
                    ignore_eos=ignore_eos_of[req_id],
                    use_stop=rng.random() < 0.3,
                    cache_salt=rng.choice([None, None, "tenant"]),
                    prompt_logprobs=rng.random() < 0.1,
                )
        live = unfinished()
        if live and rng.random() < 0.04:
            h.abort(rng.choice(live))
        during: tuple[str, ...] = ()
        if live and rng.random() < 0.03:
            during = (rng.choice(live),)
        h.step(abort_during=during)
    h.run()

    assert num_added > 300
    assert set(h.ends) == set(h.reqs), "a request never ended"
    num_compared = 0
    for req_id, req in h.reqs.items():
        ref_tokens, ref_reason = reference_output(
            req.prompt_token_ids,
            req.stopping.max_new_tokens,
            eos_of[req_id],
            ignore_eos_of[req_id],
            req_id in h.use_stop,
            repetitive,
        )
        positions = h.prompt_logprob_pos[req_id]
        assert positions == sorted(set(positions)), "a prompt logprob was delivered twice"
        if h.ends[req_id] is FinishReason.ABORTED:
            assert h.tokens[req_id] == ref_tokens[: len(h.tokens[req_id])]
            continue
        num_compared += 1
        assert (h.tokens[req_id], h.ends[req_id]) == (ref_tokens, ref_reason), req_id
        if req.sampling.prompt_logprobs:
            assert positions == list(range(1, req.num_prompt_tokens))
    assert num_compared > 250
    h.assert_all_blocks_free()
    assert not h.runner.seqs or not h.sched.has_unfinished_requests()
    stats = h.sched.stats()
    if name in PRESSURED:
        assert stats.num_preemptions > 20, stats
    if name in ("ample", "spec-ample"):
        assert stats.num_preemptions == 0
    if repetitive:
        assert stats.spec_accepted_tokens > 50, stats
    if config.enable_prefix_caching:
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.prefix_cache_queries == 0
    if ahead and not config.num_speculative_tokens:
        assert h.num_ahead > NUM_STEPS // 3, h.num_ahead  # most steps were scheduled ahead
        assert h.runner.num_filled > 0
    for before, after in itertools.pairwise(h.steps):  # drafts are never scheduled past
        if any(c.num_draft_tokens for c in before.chunks):
            assert not any(c.token_from_last_step for c in after.chunks)
