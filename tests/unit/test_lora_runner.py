"""Multi-LoRA in the model runner against PEFT + transformers on the same float32 weights.

Requests for several adapters (different ranks, target-module sets, one with rsLoRA) and for
the base model share every step (chunked prefills mixed with decodes); each request's greedy
tokens must equal PEFT's generate() with its adapter, logprobs within 1e-4.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from genserve.model.adapter_errors import AdapterError
from genserve.model.adapter_files import read_adapter
from genserve.step import AdapterRef, RunnerOutput, SchedulerOutput
from genserve.testing.tiny_lora import make_lora_adapter
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory
from tests.unit.test_model_runner import Driver, make_runner, random_prompts

pytest.importorskip("peft")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv-r8": {"rank": 8, "targets": ("q_proj", "v_proj"), "seed": 1},
    "all-r4-rslora": {"rank": 4, "targets": ALL, "use_rslora": True, "seed": 2},
    "mlp-r16": {"rank": 16, "targets": ("gate_proj", "up_proj", "down_proj"), "seed": 3},
    "ko-r2": {"rank": 2, "alpha": 4, "targets": ("k_proj", "o_proj"), "seed": 4},
}


class AdapterSteps:
    """Wraps the runner: attaches each new request's adapter, as the scheduler does."""

    def __init__(self, runner: ModelRunner, refs: dict[str, AdapterRef]) -> None:
        self.runner = runner
        self.refs = refs

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        new = tuple(
            dataclasses.replace(n, adapter=self.refs.get(n.req_id)) for n in step.new_requests
        )
        return self.runner.execute_model(dataclasses.replace(step, new_requests=new))


@pytest.fixture(scope="module")
def base_dir(tiny_model_factory: TinyModelFactory) -> Path:
    return tiny_model_factory("qwen2")  # Q/K/V biases and untied head: the harder case


@pytest.fixture(scope="module")
def adapter_dirs(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_lora_adapter(base_dir, tmp_path_factory.mktemp(name), **kwargs)
        for name, kwargs in ADAPTERS.items()
    }


def peft_greedy(
    base_dir: Path, adapter_dir: Path | None, prompt: list[int], max_new: int
) -> tuple[list[int], list[float]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens: list[int] = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(lg[0].float(), -1)[t].item()
        for lg, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def test_mixed_adapters_match_peft(base_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    names = list(ADAPTERS)
    refs = {
        f"r{i}-{name}": AdapterRef(slot, name, str(adapter_dirs[name]))
        for slot, name in enumerate(names)
        for i in range(2)
    }
    runner = make_runner(base_dir)
    driver = Driver(runner, budget=40)
    driver.runner = AdapterSteps(runner, refs)  # type: ignore[assignment]
    prompts = random_prompts([5, 23, 37, 9, 61, 14, 30, 3, 19, 44], seed=7)
    req_ids = [*refs, "base-0", "base-1"]
    reqs = [driver.add(r, p, 8) for r, p in zip(req_ids, prompts, strict=False)]
    driver.run()
    outputs = set()
    for req in reqs:
        adapter = refs[req.req_id].adapter_id if req.req_id in refs else None
        want_ids, want_lps = peft_greedy(
            base_dir,
            adapter_dirs[adapter] if adapter else None,
            req.tokens[: req.num_prompt],
            8,
        )
        assert [s.token_id for s in req.out] == want_ids, req.req_id
        assert [s.logprob for s in req.out] == pytest.approx(want_lps, abs=1e-4), req.req_id
        outputs.add(tuple(want_ids))
    # The adapters actually change the output (otherwise the test would prove nothing).
    same_prompt = prompts[0]
    per_adapter = {
        tuple(peft_greedy(base_dir, d, same_prompt, 8)[0]) for d in adapter_dirs.values()
    }
    per_adapter.add(tuple(peft_greedy(base_dir, None, same_prompt, 8)[0]))
    assert len(per_adapter) >= 4


def test_slot_reuse_replaces_the_adapter(base_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    """A slot that held one adapter and is given another serves the new one exactly."""
    runner = make_runner(base_dir)
    prompt = random_prompts([21], seed=3)[0]
    for name in ("qv-r8", "mlp-r16", "qv-r8"):
        ref = AdapterRef(0, name, str(adapter_dirs[name]))
        driver = Driver(runner, budget=64)
        driver.runner = AdapterSteps(runner, {"x": ref})  # type: ignore[assignment]
        req = driver.add("x", prompt, 6)
        driver.run()
        driver.step_id = 0
        runner.execute_model(SchedulerOutput(99, (), (), ("x",)))
        want, _ = peft_greedy(base_dir, adapter_dirs[name], prompt, 6)
        assert [s.token_id for s in req.out] == want, name


def test_wrong_shape_and_corrupt_adapters_are_rejected(
    base_dir: Path,
    adapter_dirs: dict[str, Path],
    tiny_model_factory: TinyModelFactory,
    tmp_path: Path,
) -> None:
    from genserve.model.config import load_model_config

    config = load_model_config(base_dir)
    other = tiny_model_factory("qwen2", hidden_size=96, num_attention_heads=6,
                               num_key_value_heads=3)  # fmt: skip
    wrong = make_lora_adapter(other, tmp_path / "wrong", rank=4)
    with pytest.raises(AdapterError, match=r"'wrong'.*q_proj.*needs A \[r, 64\]"):
        read_adapter("wrong", wrong, config)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (adapter_dirs["qv-r8"] / "adapter_config.json").read_text()
    )
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(AdapterError, match="'corrupt': cannot read it"):
        read_adapter("corrupt", corrupt, config)


def test_prepared_adapters_install_without_reading_on_the_step(
    base_dir: Path, adapter_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine does: prepare_adapter (a worker thread, before the request reaches
    the scheduler) reads and lays the adapter out; the step that first runs the request only
    copies it into the slot, and reads no file.  Tokens still equal PEFT's."""
    import genserve.worker.adapters as adapters_module

    runner = make_runner(base_dir)
    ref = AdapterRef(1, "all-r4-rslora", str(adapter_dirs["all-r4-rslora"]))
    runner.prepare_adapter(ref)
    runner.prepare_adapter(ref)  # a second request for it: nothing to do

    def no_reads(*args: object) -> None:
        raise AssertionError("the step thread read an adapter file")

    monkeypatch.setattr(adapters_module, "read_adapter", no_reads)
    prompt = random_prompts([17], seed=11)[0]
    driver = Driver(runner, budget=64)
    driver.runner = AdapterSteps(runner, {"p": ref})  # type: ignore[assignment]
    req = driver.add("p", prompt, 6)
    driver.run()
    want, _ = peft_greedy(base_dir, adapter_dirs["all-r4-rslora"], prompt, 6)
    assert [s.token_id for s in req.out] == want
    runner.prepare_adapter(ref)  # already in its slot: returns without reading
