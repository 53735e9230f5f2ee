"""The launcher's switches whose default depends on where the model serves (``None`` in
:class:`~genserve.config.Config`: auto): ``--overlap-scheduling`` and ``--engine-process`` are
on where the model serves on CUDA (the engine process on one GPU: it has not run across
several) and off on CPU, where neither gained (docs/gpu-step.md, docs/overlap-scheduling.md).
A value the user gave, on the command line (``--no-engine-process``) or in the environment
(``ENGINE_PROCESS=false``), stays."""

from __future__ import annotations

import dataclasses

from genserve.config import Config
from genserve.worker.shard_plan import ShardingError, resolve_num_shard


def visible_gpus() -> int:
    """CUDA devices this process may use (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def decide(config: Config, num_gpus: int) -> Config:
    """``config`` with its auto switches set for a machine with ``num_gpus`` visible GPUs."""
    on_cuda = num_gpus > 0
    overlap = config.overlap_scheduling
    if overlap is None:
        overlap = on_cuda
    engine_process = config.engine_process
    if engine_process is None:
        try:
            shards = resolve_num_shard(config.num_shard, config.sharded, num_gpus)
        except ShardingError:  # contradictory flags: the load reports them
            shards = 0
        engine_process = on_cuda and shards == 1
    return dataclasses.replace(config, overlap_scheduling=overlap, engine_process=engine_process)
