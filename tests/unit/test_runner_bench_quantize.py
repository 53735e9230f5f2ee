"""``runner_bench`` times a .gguf model as the server serves it: its blocks on CPU (the
server's ``--quantize`` default), not a bfloat16 copy of them, unless told otherwise."""

from __future__ import annotations

from pathlib import Path

import torch

from genserve.model.loader import ResolvedModel
from genserve.worker.runner_bench import default_quantize

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _model(gguf: bool) -> ResolvedModel:
    return ResolvedModel(
        local_dir=Path("/m"), model_id="m", gguf_file=Path("/m.gguf") if gguf else None
    )


def test_gguf_on_cpu_keeps_its_blocks_by_default() -> None:
    assert default_quantize(None, _model(gguf=True), CPU) == "gguf"


def test_other_models_and_devices_keep_the_dtype() -> None:
    assert default_quantize(None, _model(gguf=False), CPU) is None
    assert default_quantize(None, _model(gguf=True), CUDA) is None


def test_an_explicit_choice_wins() -> None:
    assert default_quantize("none", _model(gguf=True), CPU) is None
    assert default_quantize("int8", _model(gguf=True), CPU) == "int8"
    assert default_quantize("gguf", _model(gguf=True), CPU) == "gguf"
