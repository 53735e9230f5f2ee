"""The shard workers rank 0 starts (worker/shard_processes.py):

* what rank 0 tells them reaches their kernel settings: a worker started from
  ``WorkerSpec.argv`` parses back the flags rank 0 was given, the CPU-features mask included
  (without it, ``--num-shard 2 --cpu-features-mask avx512f`` ran AVX2 kernels on rank 0 only);
* a worker that exits while the group is serving is a failure reported once; one that exits
  after :meth:`ShardProcesses.expect_exits` (the shutdown, which says so before it sends
  SHUTDOWN) is not: a worker obeying SHUTDOWN at once used to be reported as a broken group."""

from __future__ import annotations

import sys
import threading

import pytest

from genserve.kernels.cpu_features import parse_mask
from genserve.worker import shard_worker
from genserve.worker.shard_processes import ShardProcesses, WorkerSpec


class _SleeperSpec(WorkerSpec):
    """Real processes that live until killed, in place of model workers."""

    def argv(self, rank: int, parent_fd: int) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def _spec(cls: type[WorkerSpec] = WorkerSpec, **overrides: object) -> WorkerSpec:
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
    return cls(**fields)  # type: ignore[arg-type]


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


def _kill_worker(processes: ShardProcesses) -> None:
    proc = processes.procs[1]
    proc.kill()
    proc.wait(10)


def test_an_unexpected_exit_is_reported_once_naming_the_shard() -> None:
    reasons: list[str] = []
    reported = threading.Event()
    processes = ShardProcesses(_spec(_SleeperSpec), lambda r: (reasons.append(r), reported.set()))
    try:
        _kill_worker(processes)
        assert reported.wait(10)
        assert processes.failure is not None and "shard 1" in processes.failure
        assert "SIGKILL" in reasons[0]
    finally:
        processes.stop(timeout_s=1.0)
    assert len(reasons) == 1


def test_an_exit_after_expect_exits_is_the_shutdown() -> None:
    reasons: list[str] = []
    processes = ShardProcesses(_spec(_SleeperSpec), reasons.append)
    try:
        processes.expect_exits()
        _kill_worker(processes)
        assert processes.wait_failure(0.5) is None
    finally:
        processes.stop(timeout_s=1.0)
    assert reasons == [] and processes.failure is None
