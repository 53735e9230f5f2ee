"""--rope-scaling / --rope-factor against transformers with the same ``rope_scaling`` config,
on a tiny float32 model whose context (64 positions) the prompts run past."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from genserve.model.config import RopeConfig
from genserve.model.loader import ResolvedModel
from genserve.model.rope_scaling import override, scaled_max_positions, sequence_lengths
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory
from tests.unit.test_model_runner import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    Driver,
    hf_greedy_with,
    random_prompts,
)

MAX_POS = 64


def _hf_scaled(model_dir: Path, kind: str, factor: float) -> Any:
    config = AutoConfig.from_pretrained(str(model_dir))
    scaling = {"rope_type": kind, "factor": factor}
    if getattr(config, "rope_parameters", None) is not None:  # transformers >= 5
        config.rope_parameters = {**config.rope_parameters, **scaling}
    else:
        config.rope_scaling = scaling
    return AutoModelForCausalLM.from_pretrained(str(model_dir), config=config, dtype=torch.float32)


@pytest.mark.parametrize(
    ("kind", "factor", "budget"),
    [("linear", 4.0, 256), ("dynamic", 2.0, 256), ("dynamic", 2.0, 32)],
)
def test_rope_flags_match_transformers_past_context(
    tiny_model_factory: TinyModelFactory, kind: str, factor: float, budget: int
) -> None:
    """``budget`` 32: the 90-token prompt is prefilled in chunks, each scaled by the whole
    prompt's length as transformers' one-forward prefill is (not by where it ends)."""
    model_dir = tiny_model_factory("llama", seed=11, max_position_embeddings=MAX_POS)
    runner = ModelRunner(
        ResolvedModel(model_dir, "tiny", rope_scaling=kind, rope_factor=factor),
        torch.float32,
        torch.device("cpu"),
    )
    assert runner.config.rope.rope_type == kind
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    # One prompt past the context, one inside it, batched together: the dynamic scaling of
    # one sequence must not leak into the other.
    prompts = random_prompts([90, 20], seed=12)
    driver = Driver(runner, budget=budget)
    reqs = [driver.add(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    driver.run()
    hf = _hf_scaled(model_dir, kind, factor)
    unscaled = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    for req, prompt in zip(reqs, prompts, strict=True):
        ids, lps = hf_greedy_with(hf, prompt, 10)
        assert [s.token_id for s in req.out] == ids, req.req_id
        assert [s.logprob for s in req.out] == pytest.approx(lps, abs=1e-4), req.req_id
    # The scaling is real: past the context, the unscaled model computes something else.
    _, plain_lps = hf_greedy_with(unscaled, prompts[0], 10)
    assert [s.logprob for s in reqs[0].out] != pytest.approx(plain_lps, abs=1e-4)


def test_override_semantics() -> None:
    rope = RopeConfig(theta=10000.0)
    assert override(rope, None, None, 64) is rope
    assert override(rope, None, 3.0, 64).rope_type == "linear"  # TGI: factor alone is linear
    assert override(rope, "dynamic", None, 64).params["factor"] == 1.0
    assert scaled_max_positions(64, "dynamic", 2.0) == 128
    assert scaled_max_positions(64, None, None) == 64
    with pytest.raises(ValueError, match="linear or dynamic"):
        override(rope, "yarn", 2.0, 64)


def test_sequence_lengths_split_flat_batch() -> None:
    # decode at 70, prefill 0..3, decode at 5: runs end at 70, 3, 5
    positions = torch.tensor([70, 0, 1, 2, 3, 5])
    assert sequence_lengths(positions).tolist() == [71, 4, 4, 4, 4, 6]
    # Two decode rows whose positions happen to be consecutive are two sequences.
    positions = torch.tensor([70, 71, 0, 1, 2])
    assert sequence_lengths(positions, num_decodes=2).tolist() == [71, 72, 3, 3, 3]
    assert sequence_lengths(positions[:2], num_decodes=2).tolist() == [71, 72]


def test_dynamic_adjacent_decode_rows_match_transformers(
    tiny_model_factory: TinyModelFactory,
) -> None:
    """Prompts of 80 and 81 tokens decode side by side at consecutive positions past the
    context: each must still be scaled by its own length (they were once merged into one
    run, giving the first request the second's length)."""
    model_dir = tiny_model_factory("llama", seed=11, max_position_embeddings=MAX_POS)
    runner = ModelRunner(
        ResolvedModel(model_dir, "tiny", rope_scaling="dynamic", rope_factor=2.0),
        torch.float32,
        torch.device("cpu"),
    )
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    prompts = random_prompts([80, 81], seed=14)
    driver = Driver(runner, budget=256)
    reqs = [driver.add(f"r{i}", p, 6) for i, p in enumerate(prompts)]
    driver.run()
    for req, prompt in zip(reqs, prompts, strict=True):
        # A fresh model each: transformers' dynamic rotary keeps the longest length it has
        # seen (max_seq_len_cached) across generate() calls.
        ids, lps = hf_greedy_with(_hf_scaled(model_dir, "dynamic", 2.0), prompt, 6)
        assert [s.token_id for s in req.out] == ids, req.req_id
        assert [s.logprob for s in req.out] == pytest.approx(lps, abs=1e-4), req.req_id


def test_dynamic_from_the_checkpoint_config(tiny_model_factory: TinyModelFactory) -> None:
    """A config.json that ships ``rope_scaling: dynamic`` is served like the flag."""
    model_dir = tiny_model_factory(
        "llama",
        seed=11,
        max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    runner = ModelRunner(ResolvedModel(model_dir, "tiny"), torch.float32, torch.device("cpu"))
    assert runner.config.rope.rope_type == "dynamic"
    assert runner.config.rope.params["original_max_position_embeddings"] == MAX_POS
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    prompt = random_prompts([80], seed=13)[0]
    driver = Driver(runner, budget=256)
    req = driver.add("r", prompt, 6)
    driver.run()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids, lps = hf_greedy_with(hf, prompt, 6)
    assert [s.token_id for s in req.out] == ids
    assert [s.logprob for s in req.out] == pytest.approx(lps, abs=1e-4)
