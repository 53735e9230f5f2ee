"""Speculative decoding on the scheduler side (no torch): the n-gram proposer, the adaptive
draft length, and the scheduler driving a fake runner that verifies drafts as a model does.
"""

from __future__ import annotations

import pytest
from scheduler_fakes import Harness, reference_output

from genserve.engine.request import FinishReason, Request, StoppingCriteria
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.engine.speculative import DraftLengthController, NgramProposer
from genserve.step import RunnerOutput, SampledToken, SamplingParams

# ---------------------------------------------------------------------------- proposer


def test_proposer_continues_the_most_recent_longest_match() -> None:
    p = NgramProposer(max_n=3, min_n=1)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 7, 2, 3]
    # Tail (7, 2, 3) never occurred; (2, 3) did, last followed by 4 at index 7 (not by 9).
    assert p.propose("r", tokens[:4], tokens[4:], 1) == (4,)
    # Growing the draft looks up again with the drafted token appended: (3, 4) -> 7, ...
    assert p.propose("r", tokens[:4], tokens[4:], 3) == (4, 7, 2)


def test_proposer_follows_a_cycle_beyond_the_history() -> None:
    p = NgramProposer()
    assert p.propose("r", [5, 6], [5, 6, 5], 6) == (6, 5, 6, 5, 6, 5)
    # The tail never matches itself: a sequence without repeats has no draft.
    assert p.propose("s", [1, 2, 3, 4], [], 4) == ()
    assert p.propose("t", [8], [], 4) == ()


def test_proposer_min_n_and_incremental_updates() -> None:
    p = NgramProposer(max_n=2, min_n=2)
    prompt, output = [1, 2, 3], [1]
    assert p.propose("r", prompt, output, 2) == ()  # only a 1-gram (1) matches
    output += [2]
    assert p.propose("r", prompt, output, 2) == (3, 1)  # (1, 2) -> 3, then (2, 3) -> 1
    with pytest.raises(ValueError, match="shrank"):
        p.propose("r", prompt, [], 2)
    p.forget("r")
    assert len(p) == 0
    assert p.propose("r", prompt, output, 0) == ()
    with pytest.raises(ValueError):
        NgramProposer(max_n=1, min_n=2)


def test_draft_length_grows_with_acceptance_and_backs_off_on_misses() -> None:
    c = DraftLengthController(max_len=4, max_backoff=4)
    assert c.allowed("r") == 4
    c.record("r", 4, 1)  # one of four accepted: next time two
    assert c.allowed("r") == 2
    c.record("r", 2, 2)  # all accepted: grow by one
    assert c.allowed("r") == 3
    c.record("r", 3, 0)  # a miss: skip 1 step, then drafts of 1
    assert [c.allowed("r") for _ in range(2)] == [0, 1]
    c.record("r", 1, 0)  # consecutive misses double the pause, up to max_backoff
    assert [c.allowed("r") for _ in range(3)] == [0, 0, 1]
    c.record("r", 1, 0)
    c.allowed("r")
    c.record("r", 1, 0)
    assert [c.allowed("r") for _ in range(5)] == [0, 0, 0, 0, 1]
    c.record("r", 1, 1)  # a hit halves the pause (4 -> 2); the next miss doubles it again
    assert c.allowed("r") == 2
    c.record("r", 2, 0)
    assert [c.allowed("r") for _ in range(5)] == [0, 0, 0, 0, 1]
    c.record("r", 1, 1)
    c.record("r", 2, 2)
    c.record("r", 3, 3)  # hits: 4 -> 2 -> 1 -> 0, drafts grow back
    c.record("r", 4, 0)
    assert [c.allowed("r") for _ in range(2)] == [0, 1]
    c.forget("r")
    assert c.allowed("r") == 4


# ---------------------------------------------------------------------------- scheduler


def spec_config(**overrides: int) -> SchedulerConfig:
    values = {
        "num_blocks": 64,
        "block_size": 4,
        "max_batch_prefill_tokens": 32,
        "num_speculative_tokens": 4,
        "speculate_max_batch_size": 4,
    }
    values.update(overrides)
    return SchedulerConfig(**values)  # type: ignore[arg-type]


def run_requests(config: SchedulerConfig, prompts: list[list[int]], max_new: int) -> Harness:
    h = Harness(config, repetitive=True)
    for i, prompt in enumerate(prompts):
        h.add(f"r{i}", prompt, max_new)
    h.run()
    return h


PROMPTS = [[3, 4, 5, 6], [9, 1], [17, 23, 5, 40, 41, 2, 3]]


def test_speculation_gives_the_same_tokens_in_fewer_steps() -> None:
    plain = run_requests(spec_config(num_speculative_tokens=0), PROMPTS, 100)
    spec = run_requests(spec_config(), PROMPTS, 100)
    for i, prompt in enumerate(PROMPTS):
        expected, reason = reference_output(prompt, 100, frozenset(), False, False, True)
        assert plain.tokens[f"r{i}"] == spec.tokens[f"r{i}"] == expected
        assert spec.ends[f"r{i}"] is reason is FinishReason.LENGTH
    stats = spec.sched.stats()
    assert stats.spec_draft_tokens == spec.runner.num_draft_tokens > 0
    assert stats.spec_accepted_tokens == spec.runner.num_accepted_tokens
    # The fake model loops (a 24-token cycle): once it has gone round, drafts land.
    assert stats.spec_accepted_tokens > 100
    assert len(spec.steps) < len(plain.steps) * 0.6
    assert plain.sched.stats().spec_draft_tokens == 0
    spec.assert_all_blocks_free()


@pytest.mark.parametrize("max_new", [1, 2, 3, 7])
def test_drafts_never_overshoot_max_new_tokens(max_new: int) -> None:
    h = run_requests(spec_config(), [[5, 6, 5, 6, 5, 6, 5]], max_new)
    assert len(h.tokens["r0"]) == max_new
    assert h.ends["r0"] is FinishReason.LENGTH
    for step in h.steps:
        for chunk in step.chunks:
            # The drafts and the token after them fit in what is left to generate.
            assert chunk.num_draft_tokens <= max_new - 1


def test_eos_inside_accepted_drafts_ends_there() -> None:
    prompt = [5, 6, 5, 6, 5, 6]
    expected, _ = reference_output(prompt, 30, frozenset(), False, False, True)
    eos = expected[5]  # a token the loop reaches within a few steps
    h = Harness(spec_config(), repetitive=True)
    h.add("r", prompt, 30, eos_token_ids=frozenset({eos}))
    h.run()
    ref, reason = reference_output(prompt, 30, frozenset({eos}), False, False, True)
    assert (h.tokens["r"], h.ends["r"]) == (ref, reason)
    assert reason is FinishReason.EOS_TOKEN
    h.assert_all_blocks_free()


def test_stop_string_inside_accepted_drafts_drops_the_rest() -> None:
    prompt = [7, 3, 7, 3, 7, 3]  # token 7 stands for a stop string (see is_stop_token)
    h = Harness(spec_config(), repetitive=True)
    h.add("r", prompt, 30, use_stop=True)
    h.run()
    ref, reason = reference_output(prompt, 30, frozenset(), False, True, True)
    assert (h.tokens["r"], h.ends["r"]) == (ref, reason)
    h.assert_all_blocks_free()


def test_no_drafts_above_the_batch_limit_or_with_penalties() -> None:
    h = Harness(spec_config(speculate_max_batch_size=2), repetitive=True)
    for i in range(3):
        h.add(f"r{i}", [5, 6, 5, 6, 5], 10)
    h.step()  # prefill: three running from now on
    for _ in range(4):
        assert not any(c.num_draft_tokens for c in h.step().chunks)

    sched = Scheduler(spec_config())
    req = Request("p", [5, 6, 5, 6, 5], SamplingParams(repetition_penalty=1.2), StoppingCriteria(8))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(out.step_id, (SampledToken("p", 6, -1.0),)))
    assert sched.schedule().chunks[0].num_draft_tokens == 0


def test_drafts_never_preempt() -> None:
    # Two requests fill the cache exactly; drafts would need more blocks than are free.
    config = spec_config(num_blocks=4, block_size=4)
    h = Harness(config, repetitive=True)
    h.add("a", [5, 6, 5, 6, 5, 6, 5], 1)
    h.add("b", [5, 6, 5, 6, 5, 6, 5], 1)
    h.run()
    assert h.sched.stats().num_preemptions == 0
    h2 = Harness(config, repetitive=True)
    h2.add("a", [5, 6, 5, 6, 5, 6], 2)
    h2.add("b", [5, 6, 5, 6, 5, 6], 2)
    h2.run()
    assert h2.sched.stats().num_preemptions == 0
    for name in "ab":
        expected, _ = reference_output([5, 6, 5, 6, 5, 6], 2, frozenset(), False, False, True)
        assert h2.tokens[name] == expected


def test_runner_returning_too_many_tokens_is_rejected() -> None:
    sched = Scheduler(spec_config())
    sched.add_request(Request("r", [5, 6, 5, 6, 5], SamplingParams(), StoppingCriteria(8)))
    out = sched.schedule()
    sched.update_from_output(out, RunnerOutput(out.step_id, (SampledToken("r", 6, -1.0),)))
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.num_draft_tokens > 0
    too_many = tuple(SampledToken("r", 5, -1.0) for _ in range(chunk.num_draft_tokens + 2))
    with pytest.raises(RuntimeError, match="returned"):
        sched.update_from_output(out, RunnerOutput(out.step_id, too_many))


def test_drafts_leave_the_blocks_later_requests_need_this_step() -> None:
    """``a`` (older) could take the last free block for its drafts, but ``b`` needs a new
    block for its own decode token in the same step: ``a`` decodes one token instead."""
    cycle = reference_output([3, 4, 5, 6], 40, frozenset(), False, False, True)[0]
    prompts = {"a": cycle[:31], "b": cycle[1:33]}  # both continue the fake model's loop
    config = spec_config(
        num_blocks=17, block_size=4, max_batch_prefill_tokens=64, growth_reserve_ratio=0
    )  # type: ignore[arg-type]
    h = Harness(config, repetitive=True)
    h.add("a", prompts["a"], 4)  # next position 31: still in its 8th block
    h.add("b", prompts["b"], 4)  # next position 32: needs a 9th block
    h.step()  # both prefilled: 8 + 8 blocks held, 1 free
    assert h.sched.kv.num_free_blocks == 1
    step = h.step()
    drafts = {c.req_id: c.num_draft_tokens for c in step.chunks}
    assert drafts["a"] == 0 and "b" in drafts  # b, last in the step, may draft into it
    assert h.sched.stats().num_preemptions == 0
    h.run()  # (too small a cache for both to finish without a preemption later)
    for name, prompt in prompts.items():
        assert h.tokens[name] == reference_output(prompt, 4, frozenset(), False, False, True)[0]
    # With room for both, the same requests draft from the first decode on.
    roomy = Harness(spec_config(max_batch_prefill_tokens=64), repetitive=True)
    roomy.add("a", prompts["a"], 4)
    roomy.add("b", prompts["b"], 4)
    roomy.step()
    assert all(c.num_draft_tokens > 0 for c in roomy.step().chunks)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(temperature=0.7, seed=3, presence_penalty=-1.0),
    ],
)
def test_no_drafts_with_presence_or_negative_penalties(sampling: SamplingParams) -> None:
    """A penalty changes the logits with every accepted token, so verify rows would not be
    what one-token steps see: such requests never draft (exactness of speculation)."""
    drafted = {}
    for name, params in (("plain", SamplingParams()), ("penalised", sampling)):
        sched = Scheduler(spec_config())
        sched.add_request(Request("p", [5, 6, 5, 6, 5], params, StoppingCriteria(8)))
        out = sched.schedule()  # prefill
        sched.update_from_output(out, RunnerOutput(out.step_id, (SampledToken("p", 6, -1.0),)))
        drafted[name] = sched.schedule().chunks[0].num_draft_tokens
    assert drafted["plain"] > 0  # the same request without the penalty would draft
    assert drafted["penalised"] == 0
