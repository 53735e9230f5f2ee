"""Shared fixtures: tiny random-weight Llama-family models on disk.

``tiny_model_factory(arch="llama", seed=0, **overrides)`` builds (once per session and per
arguments) a model directory with ``genserve.testing.tiny_model.make_tiny_model``;
``tiny_model_dir`` is parametrized over every architecture, so a test using it runs once per
architecture.  The models use the embedded default model's tokenizer, which the first call
converts and caches like the server does.

``triton_interpreter`` is one Python process with Triton's interpreter on
(``tests/utils/triton_interpreter.py``) that every interpreted Triton kernel check shares.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.triton_interpreter import TritonInterpreter

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
