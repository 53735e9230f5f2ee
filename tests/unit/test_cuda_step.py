"""The GPU decode step of #29 on a real GPU (marked ``cuda``: skipped without a CUDA device;
scripts/gpu-check.sh runs them): the fused Triton layer kernels against their torch
references, compiled for the GPU rather than interpreted; the fused layers inside the model
against the eager layers; and overlapped scheduling (step n + 1 scheduled while step n runs,
its tokens read from step n's sampled ids on the device) giving the same outputs as without,
on a runner that replays CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genserve.model.loader import ResolvedModel
from genserve.tokenizer import Tokenizer
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory
from tests.unit.test_overlap_model import _both, _requests
from tests.unit.test_triton_fused import (
    check_gated_act,
    check_model,
    check_norms,
    check_rotary_store_kv,
)

pytestmark = pytest.mark.cuda


def test_each_fused_kernel_matches_its_reference_on_the_gpu() -> None:
    check_norms("cuda")
    check_gated_act("cuda")
    check_rotary_store_kv("cuda")


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_fused_layers_match_the_eager_model_on_the_gpu(
    tiny_model_factory: TinyModelFactory, arch: str
) -> None:
    check_model(str(tiny_model_factory(arch)), "cuda")


def test_overlapped_scheduling_with_graphs_changes_no_output(
    tiny_model_factory: TinyModelFactory,
) -> None:
    model_dir: Path = tiny_model_factory("llama")
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cuda")
    )
    # Block size 16: the Triton decode kernel, which graphs need, takes no smaller blocks.
    runner.enable_cuda_graphs((1, 2, 4, 8), 1024, 16)
    runner.initialize_kv_cache(64, 16)
    runner.warmup()
    assert runner.cuda_graph_sizes == (1, 2, 4, 8), "capture failed: see the warning logged"
    _, _, on_runner = _both(runner, Tokenizer(model_dir), _requests, block_size=16)
    assert on_runner.placeholders > 20  # the steps were really scheduled ahead
    assert runner._graphs is not None and runner._graphs.num_runs > 0
