"""How many tensor-parallel shards to run, from ``--num-shard`` / ``--sharded`` and the
hardware, with TGI's semantics.  Pure functions (no torch), so every combination is tested.
"""

from __future__ import annotations


class ShardingError(ValueError):
    """``--num-shard`` / ``--sharded`` cannot work on this machine; the message says why."""


def check_expert_parallel(expert_parallel: bool, num_shard: int) -> None:
    """``--expert-parallel`` splits experts between shards: refused on one shard, where it
    would silently mean nothing."""
    if expert_parallel and num_shard < 2:
        raise ShardingError(
            "--expert-parallel splits the routed experts between shards: give --num-shard 2 "
            f"or more (this server runs {num_shard} shard)"
        )


def resolve_num_shard(num_shard: int | None, sharded: bool | None, num_gpus: int) -> int:
    """The number of shards to run.

    - ``--sharded false``: one shard (with ``--num-shard`` above 1 it contradicts itself).
    - ``--num-shard N``: N shards (on CUDA at most the visible GPUs; on CPU any N, the
      ranks sharing the cores).
    - neither: every visible GPU (as TGI), one shard on CPU.
    - ``--sharded true`` without ``--num-shard``: every visible GPU, which must be at least
      two; with ``--num-shard 1`` it contradicts itself.
    """
    if sharded is False:
        if num_shard is not None and num_shard > 1:  # as TGI: contradictory, not ignored
            raise ShardingError(f"--sharded false but --num-shard {num_shard}: drop one of the two")
        return 1
    if num_shard is not None and num_shard < 1:
        raise ShardingError(f"--num-shard must be at least 1, got {num_shard}")
    if num_gpus > 0 and num_shard is not None and num_shard > num_gpus:
        raise ShardingError(
            f"--num-shard {num_shard} needs {num_shard} GPUs but {num_gpus} are visible "
            "(CUDA_VISIBLE_DEVICES); lower --num-shard"
        )
    if sharded is True:
        if num_shard == 1:
            raise ShardingError(
                "--sharded true but --num-shard 1: give --num-shard 2 or more, or drop --sharded"
            )
        if num_shard is None:
            if num_gpus < 2:
                where = "no GPU is visible" if num_gpus == 0 else "only one GPU is visible"
                raise ShardingError(
                    f"--sharded true: {where}, so there is nothing to shard across by "
                    "default; give the number of shards with --num-shard N (N >= 2; on "
                    "CPU the shards share the cores)"
                )
            return num_gpus
        return num_shard
    if num_shard is None:
        return max(1, num_gpus)
    return num_shard


def cpu_threads_per_shard(num_threads: int, num_shard: int) -> int:
    """On CPU the shards share the cores: each takes an equal part of torch's thread count
    (two processes each using every core would fight over them at every collective)."""
    return max(1, num_threads // num_shard)
