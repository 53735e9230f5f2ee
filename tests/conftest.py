"""Shared fixtures: tiny random-weight Llama-family models on disk.

``tiny_model_factory(arch="llama", seed=0, **overrides)`` builds (once per session and per
arguments) a model directory with ``genserve.testing.tiny_model.make_tiny_model``;
``tiny_model_dir`` is parametrized over every architecture, so a test using it runs once per
architecture.  The models use the embedded default model's tokenizer, which the first call
converts and caches like the server does.

``default_model_float32`` is transformers' float32 model of the embedded default model, loaded
once per session for every test that compares against it.

``triton_interpreter`` is one Python process with Triton's interpreter on
(``tests/utils/triton_interpreter.py``) that every interpreted Triton kernel check shares.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.utils.triton_interpreter import TritonInterpreter

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TINY_ARCHITECTURES = ("llama", "mistral", "qwen2")

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    from genserve.testing.tiny_model import make_tiny_model

    built: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([arch, seed, overrides], sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}-{seed}")
            built[key] = make_tiny_model(out, arch, seed, **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session", params=TINY_ARCHITECTURES)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_factory: TinyModelFactory) -> Path:
    """One tiny model per architecture (the test runs for each)."""
    return tiny_model_factory(str(request.param))


@pytest.fixture(scope="session")
def default_model_float32() -> PreTrainedModel:
    """transformers' float32 model of the embedded default model (SmolLM2-135M), dequantized
    by transformers itself from the GGUF: the reference of test_model_default_slow,
    test_gguf_weights, test_default_model, test_chat_default_model and
    test_lora_default_model.  One load takes ~15-20 s of CPU (gguf-py reads the 49,152-token
    vocabulary and dequantizes every block), so it is loaded once.  Shared read-only: users
    run it under ``torch.inference_mode()`` (``generate()`` copies its generation config
    before applying arguments) and never change its weights; one that wraps it (PEFT injects
    LoRA layers in place) wraps a ``copy.deepcopy``."""
    import torch
    from transformers import AutoModelForCausalLM

    from genserve.config import load_config
    from genserve.model.loader import default_gguf_path, resolve_model

    model_dir = resolve_model(None, cache_dir=load_config([]).genserve_cache / "models").local_dir
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, gguf_file=str(default_gguf_path())
    )
    return model.eval()


@pytest.fixture(scope="session")
def triton_interpreter() -> Iterator[TritonInterpreter]:
    """The shared ``TRITON_INTERPRET=1`` worker (started by the first check that runs)."""
    interpreter = TritonInterpreter()
    yield interpreter
    interpreter.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip cleanly where torch sees no CUDA device (CI)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu-check.sh on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
