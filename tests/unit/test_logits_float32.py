"""The LM head hands float32 logits to the sampler whatever the model's dtype: in a bfloat16
model they are the float32 sums of the bfloat16 products, not rounded to bfloat16 (whose
steps, 0.125 wide near 20, made logprobs move in steps and tied candidates that differ)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.loader import ResolvedModel
from genserve.step import SamplingParams
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory
from tests.unit.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, Driver, random_prompts


class _Recording:
    """Wraps the runner's sampler, keeping every logits tensor it is handed (the runner
    calls ``launch``, which queues the sampling; ``__call__`` is launch-and-wait)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(logits.clone())
        return self.sampler(logits, *args, **kwargs)

    def launch(self, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(logits.clone())
        return self.sampler.launch(logits, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch-ops"])
def test_sampler_gets_float32_logits(
    tiny_model_factory: TinyModelFactory, dtype: torch.dtype, kernels: bool
) -> None:
    if kernels and not cpu_kernels.load():
        pytest.skip("CPU kernels did not build")
    model_dir: Path = tiny_model_factory("llama", seed=3)
    cpu_kernels.configure(enabled=kernels)
    try:
        runner = ModelRunner(ResolvedModel(model_dir, "tiny"), dtype, torch.device("cpu"))
    finally:
        cpu_kernels.configure(enabled=True)
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    recording = _Recording(runner.sampler)
    runner.sampler = recording  # type: ignore[assignment]
    driver = Driver(runner, budget=40)
    for i, prompt in enumerate(random_prompts([5, 40], seed=1)):
        driver.add(f"r{i}", prompt, 3, params=SamplingParams(prompt_logprobs=i == 1))
    driver.run()
    assert recording.seen
    for logits in recording.seen:
        assert logits.dtype == torch.float32
    every = torch.cat([t.reshape(-1) for t in recording.seen])
    # Rounded to the model's dtype, nearly every logit would change: they were not rounded.
    assert (every != every.to(dtype).float()).float().mean() > 0.5
    # The logits are the float32 product of the (rounded) final hidden states and weights.
    hidden = torch.randn(4, runner.config.hidden_size).to(dtype)
    with torch.inference_mode():
        logits = runner.model.lm_head.logits(hidden)
        weight = runner.model.embed_tokens.weight
        if weight.numel() == 0 or not runner.config.tie_word_embeddings:
            return
        expected = hidden.double() @ weight.double().t()
    torch.testing.assert_close(logits.double(), expected, atol=1e-4, rtol=1e-5)
