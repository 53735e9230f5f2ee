"""A worker that exits while the group is serving is a failure reported once; a worker that
exits after :meth:`ShardProcesses.expect_exits` (the shutdown, which says so before it sends
SHUTDOWN) is not: a worker obeying SHUTDOWN at once used to be reported as a broken group."""

from __future__ import annotations

import sys
import threading

from genserve.worker.shard_processes import ShardProcesses, WorkerSpec


class _SleeperSpec(WorkerSpec):
    """Real processes that live until killed, in place of model workers."""

    def argv(self, rank: int, parent_fd: int) -> list[str]:
        return [sys.executable, "-c", "import time; time.sleep(60)"]


def _spec() -> WorkerSpec:
    return _SleeperSpec(
        world_size=2,
        master_addr="127.0.0.1",
        master_port=1,
        model_dir="unused",
        model_id="unused",
        dtype="float32",
        memory_fraction=0.1,
        num_threads=1,
        json_output=True,
    )


def _kill_worker(processes: ShardProcesses) -> None:
    proc = processes.procs[1]
    proc.kill()
    proc.wait(10)


def test_an_unexpected_exit_is_reported_once_naming_the_shard() -> None:
    reasons: list[str] = []
    reported = threading.Event()
    processes = ShardProcesses(_spec(), lambda r: (reasons.append(r), reported.set()))
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
    processes = ShardProcesses(_spec(), reasons.append)
    try:
        processes.expect_exits()
        _kill_worker(processes)
        assert processes.wait_failure(0.5) is None
    finally:
        processes.stop(timeout_s=1.0)
    assert reasons == [] and processes.failure is None
