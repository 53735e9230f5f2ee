"""Expert parallelism (issue #26, ``--expert-parallel``) on two CPU processes (gloo): each
shard holds whole routed experts, and the model's logits equal the single-process model's
through the torch expert loop and through ``genserve::moe_experts``.

Families: Qwen2-MoE with 7 experts (an uneven 4 + 3 split; its gated shared expert stays
split by width) and gpt-oss (experts stacked interleaved, with biases: each expert's down
bias on the shard that holds it).  The 8 prompt and decode rows at top-2 choose experts of
both shards (asserted).  Each shard's expert tensors hold its own experts only, equal to
the checkpoint's."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genserve.kernels import cpu as cpu_kernels
from genserve.model.config import load_model_config
from genserve.model.moe import SparseMoeBlock
from genserve.model.registry import build_model
from genserve.model.spec import UnsupportedModelError
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import default_tokenizer_dir
from tests.conftest import TinyModelFactory
from tests.unit.test_model_tensor_parallel import free_port, run_model
from tests.utils.moe_models import make_moe_model

CPU = torch.device("cpu")
MODELS = {"qwen2_moe": {"num_experts": 7}, "gpt_oss": {}}


def _fused() -> bool:
    return cpu_kernels.usable(CPU, torch.float32)


def _run(model_dir: Path, ctx: ParallelContext, fused: bool) -> torch.Tensor:
    if not fused:
        return run_model(model_dir, ctx)
    from genserve.model import causal_lm

    original = causal_lm.DecoderForCausalLM.load_weights

    def load_then_fuse(self: causal_lm.DecoderForCausalLM, weights: SafetensorsWeights) -> None:
        original(self, weights)
        self.use_fused_cpu_ops()

    causal_lm.DecoderForCausalLM.load_weights = load_then_fuse  # type: ignore[method-assign]
    try:
        return run_model(model_dir, ctx)
    finally:
        causal_lm.DecoderForCausalLM.load_weights = original  # type: ignore[method-assign]


def _count_pairs() -> list[int]:
    """Record how many (token, choice) pairs each call of ``_own_experts`` finds local."""
    counts: list[int] = []
    original = SparseMoeBlock._own_experts

    def counting(
        self: SparseMoeBlock, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        start, stop = self.expert_range
        counts.append(int(((ids >= start) & (ids < stop)).sum()))
        return original(self, x, ids, weights)

    SparseMoeBlock._own_experts = counting  # type: ignore[method-assign]
    return counts


def _worker(rank: int, world: int, port: int, model_dirs: list[str], out_dir: str) -> None:
    faulthandler.enable(all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        ctx = ParallelContext(rank, world, expert_parallel=True)
        pairs = _count_pairs()
        for i, model_dir in enumerate(model_dirs):
            for fused in (False, True) if _fused() else (False,):
                logits = _run(Path(model_dir), ctx, fused)
                if rank == 0:
                    torch.save(logits, Path(out_dir) / f"{i}-{fused}.pt")
        torch.save(torch.tensor(pairs), Path(out_dir) / f"pairs-{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/unit/test_model_tensor_parallel.py: no gloo teardown at exit


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root, tok = tmp_path_factory.mktemp("moe-ep"), default_tokenizer_dir()
    return [make_moe_model(root / f, f, tok, seed=5, **o) for f, o in MODELS.items()]


def test_two_expert_parallel_shards_match_one(model_dirs: list[Path], tmp_path: Path) -> None:
    args = (2, free_port(), [str(d) for d in model_dirs], str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=2, join=True)  # type: ignore[attr-defined,no-untyped-call]
    for i, model_dir in enumerate(model_dirs):
        expected = run_model(model_dir, ParallelContext.single())
        for fused in (False, True) if _fused() else (False,):
            got = torch.load(tmp_path / f"{i}-{fused}.pt")
            assert got.shape == expected.shape
            assert torch.allclose(got, expected, atol=1e-4), (model_dir.name, fused)
            assert torch.equal(got.argmax(-1), expected.argmax(-1))
    # Both shards computed pairs, and together every choice exactly once: per forward, two
    # MoE layers over the 27 prompt rows, then over the 2 decode rows, top-2.
    counts = [torch.load(tmp_path / f"pairs-{r}.pt") for r in (0, 1)]
    assert all(int(c.sum()) > 0 for c in counts)
    per_forward = torch.tensor([54, 54, 4, 4])
    assert torch.equal(counts[0] + counts[1], per_forward.repeat(len(counts[0]) // 4))


def _blocks(model_dir: Path, ctx: ParallelContext) -> list[SparseMoeBlock]:
    config = load_model_config(model_dir)
    model = build_model(config, ctx, torch.float32, CPU)
    with SafetensorsWeights(model_dir) as weights:
        model.load_weights(weights)
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("index", range(len(MODELS)))
def test_each_shard_holds_only_its_experts(model_dirs: list[Path], index: int) -> None:
    """Built as rank r of 2 (no collective runs at load): rank r's w13/w2 (and gpt-oss's
    biases) are the single-process model's rows of experts [start, stop) at full width, so
    the two ranks' routed-expert bytes add up to one copy."""
    model_dir = model_dirs[index]
    with torch.inference_mode():
        whole = _blocks(model_dir, ParallelContext.single())
        shards = [_blocks(model_dir, ParallelContext(r, 2, expert_parallel=True)) for r in (0, 1)]
    num_experts = whole[0].w13.shape[0]
    assert [b.expert_range for b in (s[0] for s in shards)] == [
        (0, (num_experts + 1) // 2),
        ((num_experts + 1) // 2, num_experts),
    ]
    for layer, full in enumerate(whole):
        full_bytes = 0
        for shard in shards:
            block = shard[layer]
            start, stop = block.expert_range
            for name in ("w13", "w2", "b13", "b2"):
                mine, reference = getattr(block, name), getattr(full, name)
                if reference is None:
                    continue
                assert torch.equal(mine, reference[start:stop]), (layer, name)
            full_bytes += block.w13.nbytes + block.w2.nbytes
        assert full_bytes == full.w13.nbytes + full.w2.nbytes


def test_refused_without_experts(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("llama", seed=3)
    config = load_model_config(model_dir)
    with pytest.raises(UnsupportedModelError, match="no mixture-of-experts layers"):
        build_model(config, ParallelContext(0, 2, expert_parallel=True), torch.float32, CPU)


def test_more_shards_than_experts_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ParallelContext(0, 4, expert_parallel=True).expert_share(3)
    assert [ParallelContext(r, 3, expert_parallel=True).expert_share(8) for r in range(3)] == [
        (0, 3),
        (3, 6),
        (6, 8),
    ]
