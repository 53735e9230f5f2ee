"""best_of / n: followers share their leader's computed prompt blocks (engine/prompt_fork.py).

The paged fake runner reads every sequence back through its block table and checks it, so a
shared block holding the wrong KV, a follower writing into a shared block, or a lost tail
position fails; the harness checks refcounts against block-table owners after every step."""

from __future__ import annotations

import pytest
from scheduler_fakes import Harness, reference_output

from genserve.engine.request import FinishReason, Request, StoppingCriteria
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.step import SamplingParams

REF = {"eos_token_ids": frozenset(), "ignore_eos": False, "use_stop": False}


def cfg(**overrides: object) -> SchedulerConfig:
    base: dict[str, object] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_batch_prefill_tokens": 64,
        "growth_reserve_ratio": 0.0,
    }
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def add(h: Harness, req_id: str, prompt: list[int], max_new: int, fork_of: str | None) -> Request:
    req = Request(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(),
        stopping=StoppingCriteria(max_new, frozenset(), False),
        fork_of=fork_of,
    )
    h.sched.add_request(req)
    h.reqs[req_id] = req
    h.tokens[req_id] = []
    h.prompt_logprob_pos[req_id] = []
    return req


def add_group(h: Harness, prompt: list[int], max_new: int, n: int = 3) -> list[str]:
    ids = ["a"] + [f"a/seq{i}" for i in range(1, n)]
    for i, req_id in enumerate(ids):
        add(h, req_id, prompt, max_new, None if i == 0 else "a")
    return ids


def chunks(h: Harness, step: int) -> list[tuple[str, int, int]]:
    return [(c.req_id, c.start_pos, len(c.token_ids)) for c in h.steps[step - 1].chunks]


def assert_reference(h: Harness, req_id: str, max_new: int) -> None:
    tokens, reason = reference_output(h.reqs[req_id].prompt_token_ids, max_new, **REF)  # type: ignore[arg-type]
    assert h.tokens[req_id] == tokens, req_id
    assert h.ends[req_id] is reason, req_id


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prompt_computed_once_and_blocks_shared(prefix_caching: bool) -> None:
    h = Harness(cfg(enable_prefix_caching=prefix_caching))
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks shareable, 2 tail tokens
    ids = add_group(h, prompt, max_new=6)
    h.step()
    assert chunks(h, 1) == [("a", 0, 18)]  # only the leader prefills
    h.step()
    # The followers compute only the tail after the 4 shared blocks; the leader decodes.
    assert chunks(h, 2) == [("a", 18, 1), ("a/seq1", 16, 2), ("a/seq2", 16, 2)]
    kv = h.sched.kv
    tables = [kv.block_ids(r) for r in ids]
    assert tables[1][:4] == tables[0][:4] == tables[2][:4]
    assert len({t[4] for t in tables}) == 3  # the diverging block is each one's own
    assert all(kv.pool.blocks[b].ref_cnt == 3 for b in tables[0][:4])
    assert [h.reqs[r].num_cached_tokens for r in ids] == [0, 16, 16]
    prompt_tokens_computed = sum(
        len(c.token_ids) for s in h.steps for c in s.chunks if c.start_pos < len(prompt)
    )
    assert prompt_tokens_computed == 18 + 2 + 2  # not 3 x 18
    h.run()
    for r in ids:
        assert_reference(h, r, 6)
    h.assert_all_blocks_free()


def test_followers_wait_for_a_chunked_prefill() -> None:
    h = Harness(cfg(chunked_prefill_size=8, max_batch_prefill_tokens=16))
    ids = add_group(h, list(range(1, 31)), max_new=3, n=2)  # 30 tokens: 7 blocks shared
    for _ in range(4):
        h.step()
    assert chunks(h, 1) == [("a", 0, 8)]  # the follower waits: no duplicate prefill
    assert chunks(h, 2) == [("a", 8, 8)]
    assert chunks(h, 3) == [("a", 16, 8)]
    assert chunks(h, 4) == [("a", 24, 6)]
    h.step()
    assert chunks(h, 5) == [("a", 30, 1), ("a/seq1", 28, 2)]
    h.run()
    for r in ids:
        assert_reference(h, r, 3)
    h.assert_all_blocks_free()


def test_short_prompt_has_nothing_to_share() -> None:
    h = Harness(cfg())
    add_group(h, [1, 2, 3], max_new=2, n=2)  # shorter than a block + 1
    h.step()
    assert chunks(h, 1) == [("a", 0, 3), ("a/seq1", 0, 3)]
    h.run()
    h.assert_all_blocks_free()


def test_cancel_leader_while_follower_waits_and_cancel_follower() -> None:
    h = Harness(cfg(chunked_prefill_size=8, max_batch_prefill_tokens=16))
    add_group(h, list(range(1, 31)), max_new=4, n=3)
    h.step()
    h.abort("a")  # mid-prefill: the followers are admitted as plain requests
    h.step()
    h.step()
    h.abort("a/seq2")
    h.run()
    assert_reference(h, "a/seq1", 4)
    assert h.ends["a"] is FinishReason.ABORTED
    h.assert_all_blocks_free()


def test_preemption_with_shared_blocks_is_leak_free() -> None:
    # 12 blocks of 4: the group needs 8 + 4 + 4 blocks at the end, so some are preempted.
    h = Harness(cfg(num_blocks=12))
    ids = add_group(h, list(range(1, 19)), max_new=12, n=3)
    h.run()
    assert h.sched.stats().num_preemptions > 0
    for r in ids:
        assert_reference(h, r, 12)
    h.assert_all_blocks_free()
