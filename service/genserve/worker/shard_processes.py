"""Ranks 1..N-1 as child processes of rank 0, and the threads that watch them.

Each worker runs ``python -m genserve.worker.shard_worker`` with its rank and everything it
needs on the command line (workers read no environment of their own beyond what Python and
torch read).  Rank 0 keeps the write end of a pipe whose read end every worker holds: when
rank 0 dies, however it dies, the kernel closes that pipe and the workers exit — no orphan.
(``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that started the child exits,
and rank 0 starts workers from its model-loading thread.)  Workers run in a session of their
own, so a Ctrl-C in a terminal reaches rank 0 only and shutdown stays orderly.

One watcher thread per worker waits for its exit.  An exit rank 0 did not ask for is a
failure: :meth:`ShardProcesses.fail` records the first one and calls ``on_failure`` once,
from the watcher thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

log = structlog.get_logger("genserve.shards")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker is told (its rank is added per process)."""

    world_size: int
    master_addr: str
    master_port: int
    model_dir: str
    model_id: str
    dtype: str
    memory_fraction: float
    num_threads: int | None  # None: torch's default
    json_output: bool
    trust_remote_code: bool = False
    kernel_cache_dir: str | None = None  # genserve.kernels.cpu's build cache (None: default)
    cpu_kernels: bool = True
    cpu_int_dot: str = "auto"  # issue #28 --cpu-int-dot (auto | on | off)
    # --cpu-features-mask as given (validated by rank 0): features every rank's kernels hide
    cpu_features_mask: str = ""
    deterministic: bool = False  # --deterministic: batch-invariant kernels
    expert_parallel: bool = False  # --expert-parallel: whole routed experts per rank
    prefill_attention: str = "auto"  # issue #29 --gpu-prefill-attention
    rope_scaling: str | None = None  # issue #15 --rope-scaling / --rope-factor
    rope_factor: float | None = None
    quantize: str | None = None  # issue #14 --quantize (its canonical name)
    gguf_file: str | None = None  # the .gguf the model was converted from (--quantize gguf)

    def argv(self, rank: int, parent_fd: int) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "genserve.worker.shard_worker",
            f"--rank={rank}",
            f"--world-size={self.world_size}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            f"--model-dir={self.model_dir}",
            f"--model-id={self.model_id}",
            f"--dtype={self.dtype}",
            f"--memory-fraction={self.memory_fraction}",
            f"--parent-fd={parent_fd}",
            f"--parent-pid={os.getpid()}",
        ]
        if self.num_threads is not None:
            args.append(f"--num-threads={self.num_threads}")
        if self.json_output:
            args.append("--json-output")
        if self.rope_scaling is not None:
            args.append(f"--rope-scaling={self.rope_scaling}")
        if self.rope_factor is not None:
            args.append(f"--rope-factor={self.rope_factor}")
        if self.quantize is not None:
            args.append(f"--quantize={self.quantize}")
        if self.gguf_file is not None:
            args.append(f"--gguf-file={self.gguf_file}")
        if self.trust_remote_code:
            args.append("--trust-remote-code")
        if self.kernel_cache_dir is not None:
            args.append(f"--kernel-cache-dir={self.kernel_cache_dir}")
        if not self.cpu_kernels:
            args.append("--disable-cpu-kernels")
        args.append(f"--cpu-int-dot={self.cpu_int_dot}")
        if self.cpu_features_mask:
            args.append(f"--cpu-features-mask={self.cpu_features_mask}")
        if self.deterministic:
            args.append("--deterministic")
        if self.expert_parallel:
            args.append("--expert-parallel")
        args.append(f"--gpu-prefill-attention={self.prefill_attention}")
        return args


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` / ``was killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


class ShardProcesses:
    """The worker processes of one sharded server.

    ``on_failure(reason)`` is called at most once, from a watcher thread (or from the thread
    calling :meth:`fail`), when a worker exits unexpectedly or rank 0 reports that the group
    broke; ``reason`` names the shard, e.g. ``shard 1 (pid 4242) was killed by SIGKILL``."""

    def __init__(self, spec: WorkerSpec, on_failure: Callable[[str], None]) -> None:
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._failure: str | None = None
        self._stopping = False
        read_fd, self._lifeline = os.pipe()  # both ends non-inheritable by default
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for rank in range(1, spec.world_size):
                self.procs[rank] = subprocess.Popen(
                    spec.argv(rank, read_fd),
                    pass_fds=(read_fd,),
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except BaseException:
            self.stop(timeout_s=1.0)
            raise
        finally:
            os.close(read_fd)
        for rank, proc in self.procs.items():
            log.info("shard_started", shard=rank, pid=proc.pid)
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"genserve-shard-{rank}", daemon=True
            ).start()

    @property
    def pids(self) -> Sequence[int]:
        return [p.pid for p in self.procs.values()]

    @property
    def failure(self) -> str | None:
        """Why the group broke, or None while it is whole."""
        return self._failure

    def wait_failure(self, timeout_s: float) -> str | None:
        """The failure reason once there is one, waiting at most ``timeout_s``."""
        self._failed.wait(timeout_s)
        return self._failure

    def fail(self, reason: str) -> None:
        """Record that the group broke (first reason wins) and report it, unless stopping."""
        with self._lock:
            if self._failure is not None or self._stopping:
                return
            self._failure = reason
        self._failed.set()
        log.error("shard_failed", reason=reason)
        self._on_failure(reason)

    def _watch(self, rank: int, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        reason = f"shard {rank} (pid {proc.pid}) {describe_exit(code)}"
        if self._stopping:
            log.info("shard_exited", shard=rank, pid=proc.pid, code=code)
            return
        self.fail(reason)

    def expect_exits(self) -> None:
        """From here on a worker's exit is the shutdown, not a failure.  Called before the
        SHUTDOWN message is sent: a worker that obeys it at once may exit before
        :meth:`stop` runs, and its watcher must not report the group broken."""
        with self._lock:
            self._stopping = True

    def stop(self, timeout_s: float) -> None:
        """Make every worker exit: from here on exits are expected.  Waits ``timeout_s`` for
        them to leave by themselves (after a SHUTDOWN message), then closes the lifeline
        (workers exit on it), then SIGTERM, then SIGKILL.  Idempotent."""
        self.expect_exits()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            _wait(proc, deadline - time.monotonic())
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs.values() if p.poll() is None]
            if not alive:
                return
            if sig is signal.SIGKILL:
                log.warning("shard_kill", pids=[p.pid for p in alive])
            for proc in alive:
                proc.send_signal(sig)
            deadline = time.monotonic() + 2.0
            for proc in alive:
                _wait(proc, deadline - time.monotonic())


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(max(0.0, timeout_s))
