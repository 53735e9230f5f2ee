"""Start a genserve server as a subprocess for one benchmark run, and stop it again.

The server gets the user's arguments plus, when they are missing, ``--hostname`` and
``--port`` matching the benchmark's loopback address and ``--prometheus-port 0`` (no second
port to collide on).  Its torch thread count is set through ``OMP_NUM_THREADS`` unless the
caller's environment already sets it.  Output goes to a log file whose tail is shown when the
server dies before becoming healthy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from genserve.bench.grpc_load import wait_until_healthy


def split_server_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` cut at the first ``--``: the benchmark's own arguments, then the server's."""
    args = list(argv)
    if "--" not in args:
        return args, []
    cut = args.index("--")
    return args[:cut], args[cut + 1 :]


def _has_flag(args: list[str], *names: str) -> bool:
    return any(arg == name or arg.startswith(name + "=") for arg in args for name in names)


def server_command(server_args: list[str], host: str, port: int) -> list[str]:
    """The command line that starts genserve with ``server_args`` listening on host:port."""
    exe = Path(sys.executable).with_name("genserve")
    command = [str(exe)] if exe.exists() else [sys.executable, "-m", "genserve.cli"]
    args = list(server_args)
    if not _has_flag(args, "--hostname"):
        args += ["--hostname", host]
    if not _has_flag(args, "--port", "-p"):
        args += ["--port", str(port)]
    if not _has_flag(args, "--prometheus-port"):
        args += ["--prometheus-port", "0"]
    return command + args


class LaunchedServer:
    """A genserve subprocess, stopped (SIGTERM, then SIGKILL after ``stop_timeout_s``) on
    :meth:`stop` or when the ``with`` block ends."""

    def __init__(
        self,
        server_args: list[str],
        host: str,
        port: int,
        num_threads: int,
        log_path: Path,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.command = server_command(server_args, host, port)
        self.address = f"{host}:{port}"
        self.log_path = log_path
        self._num_threads = num_threads
        self._stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # log lines reach the file as they happen
        env.setdefault("OMP_NUM_THREADS", str(self._num_threads))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for /proc readings such as VmHWM)."""
        return None if self._process is None else self._process.pid

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    async def wait_healthy(self, timeout_s: float) -> None:
        """Wait for ``Health`` OK; fail early, with the log tail, if the process exits."""
        if self._process is None:
            raise RuntimeError("server not started")
        health = asyncio.ensure_future(wait_until_healthy(self.address, timeout_s))
        try:
            while not health.done():
                if self._process.poll() is not None:
                    raise RuntimeError(
                        f"genserve exited with code {self._process.returncode} before it was "
                        f"healthy; last lines of {self.log_path}:\n{self.log_tail()}"
                    )
                await asyncio.sleep(0.5)
            await health
        finally:
            health.cancel()

    def stop(self) -> int | None:
        """Stop the server; returns its exit code (None when it was never started)."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._process = None
        return process.returncode

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
