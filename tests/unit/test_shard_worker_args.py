"""What rank 0 tells its shard workers reaches their kernel settings: a worker started from
``WorkerSpec.argv`` parses back the flags rank 0 was given, the CPU-features mask included
(without it, ``--num-shard 2 --cpu-features-mask avx512f`` ran AVX2 kernels on rank 0 only)."""

from __future__ import annotations

import pytest

from genserve.kernels.cpu_features import parse_mask
from genserve.worker import shard_worker
from genserve.worker.shard_processes import WorkerSpec


def _spec(**overrides: object) -> WorkerSpec:
    fields: dict[str, object] = dict(
        world_size=2,
        master_addr="127.0.0.1",
        master_port=29555,
        model_dir="/models/tiny",
        model_id="tiny",
        dtype="float32",
        memory_fraction=0.3,
        num_threads=1,
        json_output=True,
    )
    fields.update(overrides)
    return WorkerSpec(**fields)  # type: ignore[arg-type]


def _worker_args(spec: WorkerSpec) -> object:
    argv = spec.argv(rank=1, parent_fd=7)
    assert argv[1:3] == ["-m", "genserve.worker.shard_worker"]
    return shard_worker._parse(argv[3:])


@pytest.mark.parametrize("mask", ["avx512f", "avx512vnni,gfni", "avx2"])
def test_the_mask_reaches_every_worker(mask: str) -> None:
    args = _worker_args(_spec(cpu_features_mask=mask, cpu_int_dot="on", deterministic=True))
    assert args.cpu_features_mask == mask  # type: ignore[attr-defined]
    assert parse_mask(args.cpu_features_mask) == parse_mask(mask)  # type: ignore[attr-defined]
    assert args.cpu_int_dot == "on" and args.deterministic  # type: ignore[attr-defined]
    assert args.rank == 1 and args.world_size == 2  # type: ignore[attr-defined]


def test_no_mask_hides_nothing() -> None:
    args = _worker_args(_spec())
    assert "--cpu-features-mask" not in " ".join(_spec().argv(rank=1, parent_fd=7))
    assert parse_mask(args.cpu_features_mask) == ()  # type: ignore[attr-defined]
