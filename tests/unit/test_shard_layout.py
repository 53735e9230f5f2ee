"""How a model is divided across shards, without running any collective: each rank reads
only its slices of the checkpoint (through ``get_slice``), the slices of the split matrices
cover each matrix exactly once across ranks, and attention heads that do not divide evenly
(the default model's 9 query / 3 KV heads on 2 shards) are spread 5/4."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest
import torch

from genserve.model.config import UnsupportedModelError, load_model_config
from genserve.model.layers import local_kv_heads
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from tests.conftest import TinyModelFactory

SPLIT = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class RecordingWeights:
    """A WeightSource over safetensors that counts the elements each tensor gave out."""

    def __init__(self, inner: SafetensorsWeights) -> None:
        self.inner = inner
        self.elements: Counter[str] = Counter()
        self.whole: list[tuple[str, int]] = []  # (name, ndim) of whole-tensor reads

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(name)

    def get(self, name: str) -> torch.Tensor:
        tensor = self.inner.get(name)
        self.whole.append((name, tensor.dim()))
        self.elements[name] += tensor.numel()
        return tensor

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        tensor = self.inner.get_slice(name, dim, start, stop)
        self.elements[name] += tensor.numel()
        return tensor


def load_rank(model_dir: Path, rank: int, world_size: int) -> RecordingWeights:
    config = load_model_config(model_dir)
    model = build_model(
        config, ParallelContext(rank, world_size), torch.float32, torch.device("cpu")
    )
    with SafetensorsWeights(model_dir) as inner:
        weights = RecordingWeights(inner)
        with torch.inference_mode():
            model.load_weights(weights)
    return weights


def test_each_rank_reads_only_its_slices(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory(
        "llama", seed=5, num_attention_heads=9, num_key_value_heads=3, hidden_size=144
    )
    ranks = [load_rank(model_dir, rank, 2) for rank in range(2)]
    with SafetensorsWeights(model_dir) as full:
        sizes = {name: full.get(name).numel() for name in full.names()}
    for weights in ranks:
        # Matrices only ever through get_slice; whole reads are 1-D (norms).
        assert all(ndim == 1 for _, ndim in weights.whole), weights.whole
        assert (
            weights.elements["model.embed_tokens.weight"]
            <= (sizes["model.embed_tokens.weight"] + 1) // 2 + 144
        )
    for name, size in sizes.items():
        total = sum(w.elements[name] for w in ranks)
        if name.endswith(tuple(f"{p}.weight" for p in SPLIT)) or "embed_tokens" in name:
            assert total == size, name  # split: every element read by exactly one rank
        elif "k_proj" in name or "v_proj" in name:
            # Each rank reads the KV heads its query heads use; with 5/4 query heads no
            # grouping is uniform: one KV head per query head, 9 heads read for 3.
            assert size <= total <= 3 * size, name


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "world_size", "expected"),
    [
        (9, 3, 2, [(0, 0, 0, 1, 1), (1, 2, 2, 2)]),  # SmolLM2 on 2 shards: 5/4 query heads
        (8, 2, 2, [(0,), (1,)]),  # even: one KV head each
        (4, 1, 2, [(0,), (0,)]),  # fewer KV heads than shards: replicated
        (6, 3, 2, [(0, 0, 1), (1, 2, 2)]),  # not divisible: one per local query head
        (6, 2, 3, [(0,), (0, 1), (1,)]),
    ],
)
def test_kv_heads_per_rank(
    num_heads: int, num_kv_heads: int, world_size: int, expected: list[tuple[int, ...]]
) -> None:
    got = [
        local_kv_heads(num_heads, num_kv_heads, ParallelContext(r, world_size))
        for r in range(world_size)
    ]
    assert got == expected


def test_balanced_shard_covers_every_unit_once() -> None:
    for size in range(1, 20):
        for world in range(1, 6):
            ranges = [ParallelContext(r, world).balanced_shard(size) for r in range(world)]
            assert ranges[0][0] == 0 and ranges[-1][1] == size
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_more_shards_than_heads_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="at most 4"):
        local_kv_heads(4, 2, ParallelContext(5, 6))
