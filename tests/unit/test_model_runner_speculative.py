"""Speculative decoding through the real scheduler and model runner (tiny float32 model):
the same tokens and logprobs as one-token steps, for greedy and for seeded sampling, while
drafts are verified in the same steps as other requests' decodes and prefill chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genserve.engine.request import Request, StoppingCriteria
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.model.loader import ResolvedModel
from genserve.step import SampledToken, SamplingParams
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory

BLOCK_SIZE = 16
NUM_BLOCKS = 96


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    motif = torch.randint(3, 1000, (7,), generator=gen).tolist()
    loose = torch.randint(3, 1000, (40,), generator=gen).tolist()
    # Repeated motifs give the n-gram proposer something to find from the first step.
    return [motif * 6, loose, motif * 3 + loose[:9], loose[:5] + motif * 4]


PARAMS = [
    SamplingParams(num_top_tokens=2),
    SamplingParams(),
    SamplingParams(temperature=0.8, top_k=20, seed=11),
    SamplingParams(temperature=1.3, top_p=0.9, seed=12, num_top_tokens=1),
]


class OracleProposer:
    """Drafts the true continuation (from a run without speculation), with every third
    draft's second token corrupted: drafts are accepted in full, in part, or not at all."""

    def __init__(self, truth: list[list[int]]) -> None:
        self.truth = {f"r{i}": tokens for i, tokens in enumerate(truth)}
        self.calls = 0

    def propose(
        self, req_id: str, prompt: list[int], output: list[int], max_tokens: int
    ) -> tuple[int, ...]:
        self.calls += 1
        done = len(output)
        draft = list(self.truth[req_id][done : done + max_tokens])
        if self.calls % 3 == 0 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % 1000
        return tuple(draft)

    def forget(self, req_id: str) -> None:
        pass


def generate(
    runner: ModelRunner, speculate: int, max_new: int, oracle: OracleProposer | None = None
) -> tuple[list[list[SampledToken]], Scheduler]:
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_batch_prefill_tokens=48,  # prompts are chunked while others decode
            num_speculative_tokens=speculate,
            speculate_max_batch_size=8,
        )
    )
    if oracle is not None:
        sched._proposer = oracle  # type: ignore[assignment]
    outputs: dict[str, list[SampledToken]] = {}
    for i, (prompt, params) in enumerate(zip(prompts(), PARAMS, strict=True)):
        sched.add_request(Request(f"r{i}", prompt, params, StoppingCriteria(max_new)))
        outputs[f"r{i}"] = []
    while sched.has_unfinished_requests():
        step = sched.schedule()
        for out in sched.update_from_output(step, runner.execute_model(step)):
            if out.new_token is not None:
                outputs[out.req_id].append(out.new_token)
        sched.check_invariants()
    assert sched.kv.num_free_blocks == NUM_BLOCKS
    return [outputs[f"r{i}"] for i in range(len(PARAMS))], sched


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculative_steps_reproduce_one_token_steps(
    tiny_model_factory: TinyModelFactory, arch: str
) -> None:
    model_dir: Path = tiny_model_factory(arch)
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cpu")
    )
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    plain, _ = generate(runner, speculate=0, max_new=48)
    # n-gram drafts: a random-weight model does not repeat its prompt, so nearly all of
    # them are rejected (the KV written for them must be overwritten, never read).
    ngram, sched = generate(runner, speculate=4, max_new=48)
    assert sched.stats().spec_draft_tokens > 0
    # Drafts that are right, partly right and wrong.
    truth = [[t.token_id for t in tokens] for tokens in plain]
    oracle, oracle_sched = generate(runner, speculate=4, max_new=48, oracle=OracleProposer(truth))
    stats = oracle_sched.stats()
    assert stats.spec_accepted_tokens > 0.5 * stats.spec_draft_tokens > 0, stats
    assert stats.spec_accepted_tokens < stats.spec_draft_tokens, stats
    for spec in (ngram, oracle):
        for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
            assert [t.token_id for t in a] == [t.token_id for t in b], f"request {i}"
            assert [t.logprob for t in a] == pytest.approx([t.logprob for t in b], abs=1e-4)
            assert [[x.token_id for x in t.top_tokens] for t in a] == [
                [x.token_id for x in t.top_tokens] for t in b
            ]
    runner.shutdown()
