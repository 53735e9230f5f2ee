"""--num-shard / --sharded resolve as in TGI; impossible combinations say what to change."""

from __future__ import annotations

import pytest

from genserve.worker.shard_plan import (
    ShardingError,
    check_expert_parallel,
    cpu_threads_per_shard,
    resolve_num_shard,
)


@pytest.mark.parametrize(
    ("num_shard", "sharded", "num_gpus", "expected"),
    [
        (None, None, 0, 1),  # CPU default: one shard
        (None, None, 1, 1),
        (None, None, 4, 4),  # CUDA default: every visible GPU
        (2, None, 0, 2),  # CPU: any N, gloo processes sharing the cores
        (2, None, 4, 2),
        (None, True, 4, 4),
        (3, True, 0, 3),
        (None, False, 4, 1),  # --sharded false deactivates --num-shard
        (1, False, 4, 1),
        (1, None, 4, 1),
    ],
)
def test_resolve(num_shard: int | None, sharded: bool | None, num_gpus: int, expected: int) -> None:
    assert resolve_num_shard(num_shard, sharded, num_gpus) == expected


@pytest.mark.parametrize(
    ("num_shard", "sharded", "num_gpus", "needle"),
    [
        (None, True, 0, "no GPU is visible"),
        (None, True, 1, "only one GPU"),
        (1, True, 0, "--num-shard 1"),
        (1, True, 8, "--num-shard 1"),
        (8, None, 2, "2 are visible"),
        (0, None, 0, "at least 1"),
        (4, False, 4, "--sharded false but --num-shard 4"),
    ],
)
def test_errors(num_shard: int | None, sharded: bool | None, num_gpus: int, needle: str) -> None:
    with pytest.raises(ShardingError, match=needle):
        resolve_num_shard(num_shard, sharded, num_gpus)


def test_cpu_threads_are_shared() -> None:
    assert cpu_threads_per_shard(2, 2) == 1
    assert cpu_threads_per_shard(8, 3) == 2
    assert cpu_threads_per_shard(1, 4) == 1


def test_expert_parallel_needs_two_shards() -> None:
    with pytest.raises(ShardingError, match="--num-shard 2 or more"):
        check_expert_parallel(True, 1)
    check_expert_parallel(True, 2)
    check_expert_parallel(False, 1)
