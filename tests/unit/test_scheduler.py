"""Scheduler behaviour, step by step (no torch).  The fake runner checks every KV read."""

from __future__ import annotations

import pytest
from scheduler_fakes import Harness, reference_output

from genserve.engine.request import FinishReason, Request, RequestStatus, StoppingCriteria
from genserve.engine.rotary_salt import LengthRotary, combine, length_rotary
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulePolicy, SchedulerConfig
from genserve.step import RunnerOutput, SamplingParams


def cfg(**overrides: object) -> SchedulerConfig:
    # Greedy admission (no growth reserve) unless a test says otherwise: these tests set up
    # exact memory pressure.
    base: dict[str, object] = {
        "num_blocks": 64,
        "block_size": 4,
        "max_batch_prefill_tokens": 64,
        "growth_reserve_ratio": 0.0,
    }
    base.update(overrides)
    return SchedulerConfig(**base)  # type: ignore[arg-type]


def chunk_shape(h: Harness, step: int) -> list[tuple[str, int, int, bool]]:
    """(req_id, start_pos, num_tokens, sample) of every chunk of step ``step`` (1-based)."""
    out = h.steps[step - 1]
    return [(c.req_id, c.start_pos, len(c.token_ids), c.sample) for c in out.chunks]


def assert_reference(h: Harness, req_id: str, max_new: int, **kw: object) -> None:
    tokens, reason = reference_output(h.reqs[req_id].prompt_token_ids, max_new, **kw)  # type: ignore[arg-type]
    assert h.tokens[req_id] == tokens
    assert h.ends[req_id] is reason


REF = {"eos_token_ids": frozenset(), "ignore_eos": False, "use_stop": False}


def test_chunked_prefill_runs_alongside_decodes() -> None:
    h = Harness(cfg(chunked_prefill_size=8, max_batch_prefill_tokens=16))
    h.add("a", [1, 2, 3], max_new_tokens=6)
    h.step()
    assert chunk_shape(h, 1) == [("a", 0, 3, True)]
    h.add("b", list(range(30)), max_new_tokens=2)
    for _ in range(4):
        h.step()
    # "a" decodes every step while "b"'s prompt goes in chunks of 8; only the last samples.
    assert chunk_shape(h, 2) == [("a", 3, 1, True), ("b", 0, 8, False)]
    assert chunk_shape(h, 3) == [("a", 4, 1, True), ("b", 8, 8, False)]
    assert chunk_shape(h, 4) == [("a", 5, 1, True), ("b", 16, 8, False)]
    assert chunk_shape(h, 5) == [("a", 6, 1, True), ("b", 24, 6, True)]
    assert [r.req_id for r in h.steps[1].new_requests] == ["b"]
    assert all(not s.new_requests for s in h.steps[2:])
    h.run()
    assert_reference(h, "a", 6, **REF)
    assert_reference(h, "b", 2, **REF)
    h.assert_all_blocks_free()


def test_prefill_budget_is_shared_in_arrival_order() -> None:
    h = Harness(cfg(max_batch_prefill_tokens=12))
    h.add("a", list(range(10)))
    h.add("b", list(range(100, 110)))
    h.add("c", [5])
    h.step()
    # a takes 10, b the 2 left, c (1 token) must wait: no overtaking the queue head.
    assert chunk_shape(h, 1) == [("a", 0, 10, True), ("b", 0, 2, False)]
    h.step()
    assert chunk_shape(h, 2) == [("a", 10, 1, True), ("b", 2, 8, True), ("c", 0, 1, True)]
    assert h.sched.stats().last_step_num_prefill_tokens == 9
    h.run()
    h.assert_all_blocks_free()


def test_finished_ids_reach_the_runner_once() -> None:
    h = Harness(cfg())
    h.add("a", [1, 2], max_new_tokens=1)
    h.add("b", [3, 4], max_new_tokens=3)
    h.step()
    assert h.ends == {"a": FinishReason.LENGTH}
    h.step()
    assert h.steps[1].finished_req_ids == ("a",)
    h.run()
    assert all("a" not in s.finished_req_ids for s in h.steps[2:])
    assert h.sched.schedule().is_empty
    h.assert_all_blocks_free()


def test_preemption_takes_the_newest_and_recomputes_exactly() -> None:
    # 3 requests of 4 prompt tokens, 6 blocks of 4: each fills a second block after one
    # decode and a third at position 8, when only the oldest can keep going.
    h = Harness(cfg(num_blocks=6, max_batch_prefill_tokens=64))
    for name in ("a", "b", "c"):
        h.add(name, [ord(name)] * 4, max_new_tokens=8)
    for _ in range(5):
        h.step()
    assert h.sched.num_running == 3 and h.sched.kv.num_free_blocks == 0
    out = h.step()  # all three need position 8: c (newest) is preempted, its 2 blocks
    # go to a and b.
    assert h.reqs["c"].status is RequestStatus.PREEMPTED
    assert h.reqs["c"].num_preemptions == 1 and h.reqs["c"].num_computed_tokens == 0
    assert "c" in out.finished_req_ids
    assert [c.req_id for c in out.chunks] == ["a", "b"]
    assert h.sched.stats().num_preemptions == 1
    h.run()
    for name in ("a", "b", "c"):
        assert_reference(h, name, 8, **REF)
    # c came back with its prompt and generated tokens, through new_requests.
    readmitted = [n for s in h.steps[6:] for n in s.new_requests if n.req_id == "c"]
    assert len(readmitted) == 1 and readmitted[0].num_output_tokens == 5
    h.assert_all_blocks_free()


def test_preempted_requests_return_to_the_queue_front_oldest_first() -> None:
    h = Harness(cfg(num_blocks=4))
    h.add("a", [1] * 8, max_new_tokens=8)  # 2 blocks, needs a third at position 8
    h.add("b", [2] * 4, max_new_tokens=4)  # 1 block, needs a second at position 4
    h.add("c", [3] * 3, max_new_tokens=4)  # 1 block, room for position 3
    h.step()
    assert h.sched.kv.num_free_blocks == 0
    h.add("d", [4] * 4, max_new_tokens=4)
    out = h.step()
    # a preempts c (the newest); b then finds nothing free and, being the newest left,
    # preempts itself.  Both go back to the front, older first, ahead of d.
    assert [c.req_id for c in out.chunks] == ["a"]
    assert set(out.finished_req_ids) == {"b", "c"}
    assert not out.new_requests  # nothing is admitted in a step that preempted
    assert [r.req_id for r in h.sched._waiting] == ["b", "c", "d"]
    h.run()
    for name, n in (("a", 8), ("b", 4), ("c", 4), ("d", 4)):
        assert_reference(h, name, n, **REF)
    h.assert_all_blocks_free()


def test_request_that_cannot_grow_preempts_itself_and_waits() -> None:
    h = Harness(cfg(num_blocks=3))
    h.add("a", [1] * 6, max_new_tokens=3)  # 2 blocks, positions 6..7 still free
    h.add("b", [2] * 4, max_new_tokens=8)  # 1 block, needs a second at position 4
    h.step()
    out = h.step()
    assert [c.req_id for c in out.chunks] == ["a"]
    assert h.reqs["b"].status is RequestStatus.PREEMPTED and out.finished_req_ids == ("b",)
    h.run()
    assert_reference(h, "a", 3, **REF)
    assert_reference(h, "b", 8, **REF)
    h.assert_all_blocks_free()


def test_finish_requests_in_every_state() -> None:
    h = Harness(cfg(max_batch_prefill_tokens=8, chunked_prefill_size=4))
    h.add("run", [1, 2, 3], max_new_tokens=50)
    h.add("mid", list(range(20)), max_new_tokens=50)
    h.step()
    h.add("wait", [4, 5], max_new_tokens=5)
    used = h.sched.kv.num_used_blocks
    h.abort("wait")  # never scheduled: the runner never hears of it
    h.abort("mid")  # half-way through its prompt
    assert h.sched.kv.num_used_blocks < used
    h.step(abort_during=("run",))  # cancelled while its step runs: no token afterwards
    assert len(h.tokens["run"]) == 1
    assert h.steps[1].finished_req_ids == ("mid",)  # "wait" never reached the runner
    h.sched.finish_requests(["run", "nope"], FinishReason.ABORTED)  # no-ops
    assert not h.sched.has_unfinished_requests()
    assert h.sched.schedule().is_empty
    h.add("next", [9, 9], max_new_tokens=2)
    h.step()
    assert h.steps[-1].finished_req_ids == ("run",)
    h.run()
    assert h.ends["next"] is FinishReason.LENGTH
    h.assert_all_blocks_free()


def test_eos_length_and_ignore_eos() -> None:
    prompt = [3, 1, 4, 1, 5]
    ref, _ = reference_output(prompt, 10, frozenset(), False, False)
    eos = ref[2]
    first_eos = ref.index(eos) + 1
    h = Harness(cfg())
    h.add("eos", prompt, max_new_tokens=10, eos_token_ids=frozenset({eos}))
    h.add("ignore", prompt, max_new_tokens=10, eos_token_ids=frozenset({eos}), ignore_eos=True)
    # The EOS token is also the last allowed token: length wins, as in TGI.
    h.add("both", prompt, max_new_tokens=first_eos, eos_token_ids=frozenset({eos}))
    h.run()
    assert h.tokens["eos"] == ref[:first_eos] and h.ends["eos"] is FinishReason.EOS_TOKEN
    assert h.tokens["ignore"] == ref and h.ends["ignore"] is FinishReason.LENGTH
    assert h.ends["both"] is FinishReason.LENGTH
    h.assert_all_blocks_free()


def test_prefix_cache_hit_is_reported_and_output_unchanged() -> None:
    h = Harness(cfg())
    shared = list(range(20))
    h.add("first", shared, max_new_tokens=3)
    h.run()
    h.add("second", [*shared, 77], max_new_tokens=3)
    h.add("salted", [*shared, 77], max_new_tokens=3, cache_salt="other-tenant")
    h.step()
    by_id = {c.req_id: c for c in h.steps[-1].chunks}
    assert by_id["second"].start_pos == 20 and len(by_id["second"].token_ids) == 1
    assert by_id["salted"].start_pos == 0
    h.run()
    assert h.reqs["second"].num_cached_tokens == 20
    assert h.reqs["salted"].num_cached_tokens == 0
    assert_reference(h, "second", 3, **REF)
    assert h.tokens["salted"] == h.tokens["second"]
    stats = h.sched.stats()
    assert stats.prefix_cache_hits == 20 and stats.prefix_cache_queries == 20 + 21 + 21
    h.assert_all_blocks_free()


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_length_dependent_rotary_shares_blocks_within_a_regime(kind: str) -> None:
    """Longrope / dynamic NTK rotate a prompt by its whole length (original context 24
    here): a prompt past it must not reuse the blocks a shorter prompt computed with the
    same tokens, and a prompt inside it shares as usual.  Longrope has one long regime, so
    two long prompts share; dynamic NTK scales by the exact length, so they do not."""
    h = Harness(cfg(length_rotary=LengthRotary(kind, 24)))  # type: ignore[arg-type]
    shared = list(range(1, 21))
    h.add("short", shared, max_new_tokens=2)
    h.run()
    h.add("short-too", [*shared, 90], max_new_tokens=2)  # 21 tokens: same regime
    h.add("long", [*shared, *range(100, 110)], max_new_tokens=2)  # 30 tokens
    h.run()
    h.add("long-too", [*shared, *range(100, 110), 7], max_new_tokens=2)  # 31 tokens
    h.run()
    cached = {r: h.reqs[r].num_cached_tokens for r in ("short-too", "long", "long-too")}
    assert cached["short-too"] == 20 and cached["long"] == 0  # blocks of 4 tokens
    assert cached["long-too"] == (28 if kind == "longrope" else 0)
    assert h.reqs["long"].cache_salt == ("rope:long" if kind == "longrope" else "rope:ntk:30")
    h.assert_all_blocks_free()


def test_rotary_regime_joins_an_adapter_salt() -> None:
    assert combine("lora:a", LengthRotary("longrope", 8).salt(9)) == "lora:a|rope:long"
    assert combine("lora:a", LengthRotary("longrope", 8).salt(8)) == "lora:a"
    assert combine(None, None) is None
    assert length_rotary("longrope", {"original_max_position_embeddings": 4096}) == (
        LengthRotary("longrope", 4096)
    )
    assert length_rotary("yarn", {"original_max_position_embeddings": 4096}) is None


def test_prefix_caching_disabled_computes_everything() -> None:
    h = Harness(cfg(enable_prefix_caching=False))
    h.add("first", list(range(20)), max_new_tokens=2)
    h.run()
    h.add("second", list(range(20)), max_new_tokens=2)
    h.step()
    assert chunk_shape(h, len(h.steps)) == [("second", 0, 20, True)]


def test_prompt_logprobs_bypass_cache_and_cover_every_position_once() -> None:
    h = Harness(cfg(chunked_prefill_size=8))
    h.add("first", list(range(20)), max_new_tokens=2)
    h.run()
    h.add("lp", list(range(20)), max_new_tokens=2, prompt_logprobs=True)
    h.run()
    assert h.reqs["lp"].num_cached_tokens == 0
    assert h.prompt_logprob_pos["lp"] == list(range(1, 20))


def test_tgi_policy_prefills_whole_prompts_even_above_the_budget_alone() -> None:
    h = Harness(cfg(chunked_prefill_enabled=False, max_batch_prefill_tokens=8))
    h.add("big", list(range(20)), max_new_tokens=2)
    h.add("small", [1, 2, 3], max_new_tokens=2)
    h.step()
    assert chunk_shape(h, 1) == [("big", 0, 20, True)]  # alone, and nothing after it
    h.step()
    assert chunk_shape(h, 2) == [("big", 20, 1, True), ("small", 0, 3, True)]
    h.run()
    h.assert_all_blocks_free()


def test_tgi_policy_waiting_served_ratio_and_max_waiting_tokens() -> None:
    h = Harness(cfg(chunked_prefill_enabled=False, max_waiting_tokens=5, num_blocks=256))
    for i in range(10):
        h.add(f"r{i}", [i, i], max_new_tokens=100)
    h.step()  # empty batch: admitted at once
    assert h.sched.num_running == 10
    for i in range(11):
        h.add(f"w{i}", [50 + i], max_new_tokens=5)
    # 11 waiting < floor(10 * 1.2) = 12: decode only, until 5 "waiting tokens" have passed
    # (TGI: the check after the initial prefill sees 1, each decode adds 1).
    for _ in range(4):
        assert all(len(c.token_ids) == 1 and c.start_pos > 1 for c in h.step().chunks)
    assert h.sched.num_waiting == 11
    assert len(h.step().new_requests) == 11
    # A 12th waiting request alone is then not enough for the 21-request batch, but 26
    # waiting requests are admitted at once.
    h.add("late", [1], max_new_tokens=5)
    assert not h.step().new_requests
    for i in range(25):
        h.add(f"x{i}", [i], max_new_tokens=5)
    assert len(h.step().new_requests) == 26
    h.run()
    h.assert_all_blocks_free()


def test_tgi_policy_needs_the_minimum_batch_to_fit() -> None:
    h = Harness(cfg(chunked_prefill_enabled=False, max_num_running=15, max_waiting_tokens=4))
    for i in range(10):
        h.add(f"r{i}", [i], max_new_tokens=50)
    h.step()
    for i in range(12):
        h.add(f"w{i}", [i], max_new_tokens=5)
    free = h.sched.kv.num_free_blocks
    # 12 waiting meet the ratio but only 5 slots are left: nothing is admitted (and the
    # tentative allocations are rolled back) until max_waiting_tokens forces a batch.
    assert not h.step().new_requests
    assert h.sched.kv.num_free_blocks == free
    assert not h.step().new_requests and not h.step().new_requests
    assert len(h.step().new_requests) == 5
    assert h.sched.num_running == 15
    h.run()
    h.assert_all_blocks_free()


def test_max_num_running_caps_the_batch_with_chunking_too() -> None:
    h = Harness(cfg(max_num_running=2))
    for i in range(4):
        h.add(f"r{i}", [i, i], max_new_tokens=3)
    h.step()
    assert h.sched.num_running == 2 and h.sched.num_waiting == 2
    h.run()
    assert max(len(s.chunks) for s in h.steps) == 2


@pytest.mark.parametrize(
    ("policy", "queue_limit", "first"),
    [
        (SchedulePolicy.LPM, 128, "hit"),
        (SchedulePolicy.FCFS, 128, "miss"),
        (SchedulePolicy.LPM, 1, "miss"),  # queue longer than the limit: fcfs
    ],
)
def test_lpm_admits_the_longest_cached_prefix_first(
    policy: SchedulePolicy, queue_limit: int, first: str
) -> None:
    h = Harness(cfg(policy=policy, lpm_max_queue_len=queue_limit, max_num_running=1))
    system_prompt = list(range(16))
    h.add("warm", [*system_prompt, 1], max_new_tokens=1)
    h.run()
    h.add("miss", [9] * 17, max_new_tokens=1)
    h.add("hit", [*system_prompt, 2], max_new_tokens=1)
    out = h.step()
    assert [c.req_id for c in out.chunks] == [first]
    h.run()
    h.assert_all_blocks_free()


def test_add_request_validation() -> None:
    sched = Scheduler(cfg(num_blocks=4))  # 16 tokens of KV

    def req(req_id: str, prompt: list[int], max_new: int) -> Request:
        return Request(req_id, prompt, SamplingParams(), StoppingCriteria(max_new))

    sched.add_request(req("ok", [1] * 10, 6))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("ok", [1], 1))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(req("empty", [], 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        sched.add_request(req("zero", [1], 0))
    with pytest.raises(ValueError, match="17 tokens"):
        sched.add_request(req("big", [1] * 10, 7))
    assert sched.max_tokens_per_request == 16
    assert sched.num_waiting == 1


def test_mismatched_runner_output_is_rejected_without_side_effects() -> None:
    h = Harness(cfg())
    h.add("a", [1, 2, 3])
    out = h.sched.schedule()
    h.runner.execute_model(out)  # the runner registered "a", then (say) failed
    with pytest.raises(RuntimeError, match="returned 0 tokens"):
        h.sched.update_from_output(out, RunnerOutput(out.step_id))
    with pytest.raises(RuntimeError, match="result of step"):
        h.sched.update_from_output(out, RunnerOutput(out.step_id + 1))
    assert h.reqs["a"].num_computed_tokens == 0 and not h.reqs["a"].output_token_ids
    # What the engine does when the runner fails: end the step's requests with ERROR.
    h.sched.finish_requests([c.req_id for c in out.chunks], FinishReason.ERROR)
    assert h.reqs["a"].finish_reason is FinishReason.ERROR
    h.assert_all_blocks_free()
    h.add("b", [4, 5])
    h.run()
    assert h.steps[0].finished_req_ids == ("a",)
    assert h.ends == {"b": FinishReason.LENGTH}


def test_stats() -> None:
    h = Harness(cfg(num_blocks=8))
    h.add("a", list(range(9)), max_new_tokens=4)
    h.add("b", [1], max_new_tokens=4)
    h.step()
    stats = h.sched.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 0)
    assert stats.num_used_blocks == 4 and stats.num_total_blocks == 8
    assert stats.kv_usage == 0.5
    assert (stats.last_step_num_reqs, stats.last_step_num_tokens) == (2, 10)
    assert stats.last_step_num_prefill_tokens == 10


def test_growth_reserve_holds_admissions_back() -> None:
    # 16 blocks.  "a" (1 block now) may still generate 47 tokens: with ratio 1.0 those
    # 12 blocks stay free, so "b" (4 blocks) waits; with ratio 0 it is admitted at once.
    for ratio, admitted in ((1.0, False), (0.0, True)):
        h = Harness(cfg(num_blocks=16, growth_reserve_ratio=ratio))
        h.add("a", [1, 2, 3], max_new_tokens=48)
        h.step()
        h.add("b", list(range(14)), max_new_tokens=2)
        out = h.step()
        assert bool(out.new_requests) is admitted
        h.run()
        assert_reference(h, "b", 2, **REF)
        h.assert_all_blocks_free()


def test_growth_reserve_is_never_applied_to_an_empty_batch() -> None:
    h = Harness(cfg(num_blocks=4, growth_reserve_ratio=1.0))
    h.add("a", list(range(10)), max_new_tokens=6)  # the whole cache, eventually
    h.add("b", [1], max_new_tokens=1)
    h.step()
    assert [c.req_id for c in h.steps[0].chunks] == ["a"]
    h.run()
    assert h.ends == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_learned_growth_ratio_follows_finished_requests() -> None:
    h = Harness(cfg(growth_reserve_ratio=None))
    assert h.sched.stats().growth_reserve_ratio == 0.5
    for i in range(40):  # every request generates all of max_new_tokens
        h.add(f"full{i}", [i], max_new_tokens=2)
    h.run()
    high = h.sched.stats().growth_reserve_ratio
    assert high > 0.9
    # Requests stopped after 1 of 10 tokens (a stop string) pull it down; cancelled ones
    # say nothing about lengths and leave it alone.
    for i in range(40):
        h.add(f"stop{i}", [i], max_new_tokens=10)
    h.step()
    for i in range(40):
        h.abort(f"stop{i}", FinishReason.STOP_SEQUENCE)
    low = h.sched.stats().growth_reserve_ratio
    assert low < 0.3
    h.add("cancelled", [1], max_new_tokens=10)
    h.step()
    h.abort("cancelled")
    assert h.sched.stats().growth_reserve_ratio == low


def test_batch_arrivals_holds_arrivals_with_chunked_prefill_too() -> None:
    """--prefill-batching: TGI's rule with chunked prefill (CUDA graphs: a step with a
    prefill chunk runs eagerly, so arrivals are gathered into fewer such steps)."""
    for batch_arrivals, held in ((False, 0), (True, 3)):
        h = Harness(cfg(max_waiting_tokens=4, num_blocks=256, batch_arrivals=batch_arrivals))
        for i in range(5):
            h.add(f"r{i}", [i, i], max_new_tokens=50)
        h.step()  # nothing running: admitted at once either way
        assert h.sched.num_running == 5
        h.add("late", [7, 8, 9], max_new_tokens=5)
        # 1 waiting < floor(5 * 1.2): decode steps only, until 4 "waiting tokens" passed.
        for _ in range(held):
            assert not h.step().new_requests
        assert [n.req_id for n in h.step().new_requests] == ["late"]
        h.run()
        h.assert_all_blocks_free()


def test_prefill_batching_auto_follows_cuda_graphs() -> None:
    from genserve.cli import batch_arrivals

    assert batch_arrivals("auto", graphs_replayed=True)
    assert not batch_arrivals("auto", graphs_replayed=False)
    assert batch_arrivals("on", graphs_replayed=False)
    assert not batch_arrivals("off", graphs_replayed=True)
