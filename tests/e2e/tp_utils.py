"""Helpers for the tensor-parallel e2e tests: several real servers started at once, and the
shard worker processes behind a server (found through Linux's /proc)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.live_server import LiveServer, free_port, start_server

SERVER_ARGS = PARITY_SERVER_ARGS


def shard_args(num_shard: int) -> tuple[str, ...]:
    """``--num-shard N`` with a free rendezvous port (tests run servers side by side)."""
    return ("--num-shard", str(num_shard), "--master-port", str(free_port()))


@contextmanager
def start_servers(
    specs: Sequence[tuple[Path, tuple[str, ...]]], timeout_s: float = 300.0
) -> Iterator[list[LiveServer]]:
    """Start one server per ``(model_dir, extra_args)`` at the same time (loading overlaps)
    and yield them once all are serving."""
    with ExitStack() as stack:
        servers = [
            stack.enter_context(start_server(model_dir, *args, wait_serving=False))
            for model_dir, args in specs
        ]
        for server in servers:
            server.wait_for(want_serving=True, timeout_s=timeout_s)
        yield servers


def shard_workers(server: LiveServer) -> list[int]:
    """Pids of the shard worker processes of ``server`` (its children running the worker
    module; rank 0 starts them from a thread, so every thread's children are read)."""
    return shard_workers_of(server.proc.pid)


def shard_workers_of(pid: int) -> list[int]:
    """Pids of the shard workers rank 0 (process ``pid``: a server, or its --engine-process
    child) started."""
    return sorted(c for c in _children(pid) if "genserve.worker.shard_worker" in _cmdline(c))


def engine_children(pid: int) -> list[int]:
    """The --engine-process child of server ``pid`` (spawned by multiprocessing; not its
    resource tracker)."""
    return sorted(c for c in _children(pid) if "spawn_main" in _cmdline(c))


def _children(pid: int) -> set[int]:
    pids: set[int] = set()
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with suppress(OSError):  # a thread that ended meanwhile
            pids.update(int(child) for child in children.read_text().split())
    return pids


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait until no process in ``pids`` runs (zombies count as gone); returns those left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if _running(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows "(comm)"
