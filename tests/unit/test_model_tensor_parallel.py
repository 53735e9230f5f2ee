"""The tensor-parallel layers on two CPU processes (gloo): logits of the sharded model equal
the single-process model's, including uneven KV-head assignment and the vocab-split head.

Only the model is tested here (every rank is given the same step); broadcasting steps from
rank 0 is the runner's concern."""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.config import load_model_config
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from tests.conftest import TinyModelFactory

CPU = torch.device("cpu")


def run_model(model_dir: Path, ctx: ParallelContext) -> torch.Tensor:
    """Prefill two sequences, then one decode step for both; logits of every sampled row."""
    torch.manual_seed(0)
    config = load_model_config(model_dir)
    with torch.inference_mode():
        model = build_model(config, ctx, torch.float32, CPU)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        backend = TorchPagedAttention(CPU)
        shape = backend.kv_cache_shape(16, 16, model.num_local_kv_heads, config.head_dim)
        caches = [torch.zeros(shape) for _ in range(config.num_layers)]
        prompts = [torch.randint(3, 1000, (n,)) for n in (20, 7)]
        seqs = [SeqSpec(20, 0, (3, 5)), SeqSpec(7, 0, (9,))]
        hidden = model(torch.cat(prompts), torch.cat([torch.arange(20), torch.arange(7)]), caches,
                       backend.build(seqs, 0, 16))  # fmt: skip
        first = model.compute_logits(hidden[[19, 26]])
        nxt = first.argmax(-1)
        seqs = [SeqSpec(1, 20, (3, 5)), SeqSpec(1, 7, (9,))]
        hidden = model(nxt, torch.tensor([20, 7]), caches, backend.build(seqs, 2, 16))
        return torch.cat([first, model.compute_logits(hidden)])


def _worker(rank: int, world: int, port: int, model_dirs: list[str], out_dir: str) -> None:
    # Should a rank still abort, its stderr names the line it was on.
    faulthandler.enable(all_threads=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        torch.set_num_threads(1)
        for i, model_dir in enumerate(model_dirs):
            logits = run_model(Path(model_dir), ParallelContext(rank, world))
            if rank == 0:
                torch.save(logits, Path(out_dir) / f"{i}.pt")
        # Both ranks reach teardown together: a rank tearing gloo down while its peer still
        # has a collective in flight can abort ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave the way genserve's shard workers leave (shard_worker.main): without interpreter
    # teardown.  Destroying c10d/gloo's C++ state at interpreter exit aborted a rank once in
    # CI after every result was written; that exit path is not what this test checks.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_shards_match_one(tiny_model_factory: TinyModelFactory, tmp_path: Path) -> None:
    """4 query / 2 KV heads split evenly; 6 query / 3 KV heads split unevenly (each rank
    stores one KV head per query head).  One spawn for both: starting processes is slow."""
    model_dirs = [
        tiny_model_factory("llama", seed=3),
        tiny_model_factory(
            "llama", seed=3, num_attention_heads=6, num_key_value_heads=3, hidden_size=96
        ),
    ]
    args = (2, free_port(), [str(d) for d in model_dirs], str(tmp_path))
    mp.spawn(_worker, args=args, nprocs=2, join=True)  # type: ignore[attr-defined,no-untyped-call]
    for i, model_dir in enumerate(model_dirs):
        expected = run_model(model_dir, ParallelContext.single())
        got = torch.load(tmp_path / f"{i}.pt")
        assert got.shape == expected.shape == (4, 49152)
        assert torch.allclose(got, expected, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
