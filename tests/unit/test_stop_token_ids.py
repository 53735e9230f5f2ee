"""stop_token_ids in the scheduler's finish check, with speculative decoding on: a stop id
met inside accepted drafts ends the request there (the tokens after it are dropped) with
STOP_SEQUENCE, whatever ignore_eos says, and every block comes back."""

from __future__ import annotations

import dataclasses

import pytest

from genserve.engine.request import FinishReason
from tests.unit.scheduler_fakes import Harness, reference_output
from tests.unit.test_speculative import spec_config


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("speculate", [0, 4])
def test_stop_token_inside_accepted_drafts_ends_there(ignore_eos: bool, speculate: int) -> None:
    # The fake model loops (a 24-token cycle): a prompt holding one round of it gets drafts
    # accepted from the first decode step on.
    base = [5, 6, 5, 6, 5, 6]
    long, _ = reference_output(base, 90, frozenset(), False, False, True)
    prompt = base + long[:30]
    expected = long[30:]
    stop_id = expected[7]  # first met mid-way through the second step's accepted drafts
    first = expected.index(stop_id)
    h = Harness(spec_config(num_speculative_tokens=speculate), repetitive=True)
    req = h.add("r", prompt, 60, ignore_eos=ignore_eos)
    req.stopping = dataclasses.replace(req.stopping, stop_token_ids=frozenset({stop_id}))
    h.run()
    assert h.tokens["r"] == expected[: first + 1]
    assert h.ends["r"] is FinishReason.STOP_SEQUENCE
    if speculate:
        assert h.sched.stats().spec_accepted_tokens > 0
        last = [c for step in h.steps for c in step.chunks if c.req_id == "r"][-1]
        assert last.num_draft_tokens > 0  # the stop id came back as a verified draft
    h.assert_all_blocks_free()


def test_eos_wins_over_a_stop_id_and_ignore_eos_keeps_going() -> None:
    prompt = [5, 6, 5, 6, 5, 6]
    expected, _ = reference_output(prompt, 40, frozenset(), False, False, True)
    eos, stop_id = expected[3], expected[30]
    assert stop_id not in expected[:30] or expected.index(stop_id) > expected.index(eos)
    h = Harness(spec_config(), repetitive=True)
    h.add("a", prompt, 40, eos_token_ids=frozenset({eos}))
    b = h.add("b", prompt, 40, eos_token_ids=frozenset({eos}), ignore_eos=True)
    b.stopping = dataclasses.replace(b.stopping, stop_token_ids=frozenset({stop_id}))
    h.run()
    assert h.ends["a"] is FinishReason.EOS_TOKEN
    assert h.tokens["a"] == expected[: expected.index(eos) + 1]
    assert h.ends["b"] is FinishReason.STOP_SEQUENCE
    assert h.tokens["b"] == expected[: expected.index(stop_id) + 1]
    h.assert_all_blocks_free()
