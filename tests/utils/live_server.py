"""A real ``genserve`` server process for tests: the console script on a free port, its logs in a
file, started and stopped the way an operator would (signals).

    with start_server(model_dir, "--max-concurrent-requests", "4") as server:
        channel = grpc.insecure_channel(server.address)
        ...
        server.stop(signal.SIGTERM)   # optional; leaving the block stops it too

``GENSERVE_BIN`` overrides the executable."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


def genserve_command() -> list[str]:
    """How to run the launcher: $GENSERVE_BIN, else the console script next to this Python."""
    if os.environ.get("GENSERVE_BIN"):
        return [os.environ["GENSERVE_BIN"]]
    script = Path(sys.executable).with_name("genserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "genserve.cli"]


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (the server binds it right after).

    Taken below the kernel's ephemeral range (where ``bind(0)`` and every outgoing
    connection's local end are picked from): a port chosen there can be handed to any
    process's next connection during the seconds before the server binds it, and on a busy
    CI host (gRPC clients, nginx upstreams, other test runs) that happens.  Random among
    thousands, so two test runs at once rarely meet either; a lost race of the gRPC port is
    retried by ``start_server``."""
    low, _ = _ephemeral_range()
    first = max(1024, low - _OWN_PORTS)
    for _ in range(100 if first < low else 0):
        port = random.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: another one
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # below is all taken
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# How many ports under the ephemeral range free_port() draws from.
_OWN_PORTS = 10_000


def _ephemeral_range() -> tuple[int, int]:
    """Linux's ip_local_port_range (its default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


# What genserve logs once its gRPC port is bound (cli.py's "listening" event, with the address).
_LISTENING = "listening"


class ServerExited(RuntimeError):
    """The server process ended before it was expected to; the message holds its log tail."""


class LiveServer:
    """A running ``genserve`` process.  ``address`` is host:port for gRPC clients."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        # TLS servers: the channel credentials health checks use (None: plaintext).
        self.credentials: grpc.ChannelCredentials | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def logs(self) -> str:
        """Everything the process printed so far ("" once discarded)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def health_status(self, service: str = "", timeout_s: float = 2.0) -> int | None:
        """grpc.health.v1 status for ``service``, or None when the port does not answer."""
        if self.credentials is None:
            channel = grpc.insecure_channel(self.address)
        else:
            channel = grpc.secure_channel(self.address, self.credentials)
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                request = health_pb2.HealthCheckRequest(service=service)
                reply = stub.Check(request, timeout=timeout_s)
            except grpc.RpcError:
                return None
            return int(reply.status)

    def wait_for(self, want_serving: bool, timeout_s: float = 300.0) -> None:
        """Until health answers SERVING (want_serving) or answers at all (not want_serving:
        the port is open and the model is loading).  ServerExited if the process ends first,
        TimeoutError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerExited(f"genserve exited with {self.proc.returncode}:\n{self._tail()}")
            # Until the log says this process listens, an answer could come from another
            # process that holds the port (ours then fails to bind and exits).
            if not self._logged_listening():
                time.sleep(0.05)
                continue
            status = self.health_status(timeout_s=1.0)
            if status is not None and (status == SERVING or not want_serving):
                return
            time.sleep(0.05 if not want_serving else 0.2)
        raise TimeoutError(f"genserve not {'serving' if want_serving else 'up'}:\n{self._tail()}")

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send ``sig`` (if still running) and wait for the exit code; SIGKILL after
        ``timeout_s``.  Idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def _logged_listening(self) -> bool:
        """Whether the log has cli.py's "listening" event with this server's gRPC address."""
        address = self.address
        return any(_LISTENING in line and address in line for line in self.logs().splitlines())

    def discard(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL) and delete its log."""
        self.stop()
        self.log_path.unlink(missing_ok=True)

    def _tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.logs().splitlines()[-num_lines:])


@contextmanager
def start_server(
    model_dir: Path | str,
    *extra_args: str,
    env: Mapping[str, str] | None = None,
    wait_serving: bool = True,
    timeout_s: float = 300.0,
    port: int | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[LiveServer]:
    """Start ``genserve --model-id MODEL_DIR --hostname 127.0.0.1 --port FREE EXTRA_ARGS...``
    and yield it once health says SERVING (or, with ``wait_serving=False``, once the port
    answers health at all, i.e. while the model may still be loading).  ``env`` is added to
    this process's environment; ``port`` defaults to a free one (if another process takes it
    before genserve binds it, up to three ports are tried, each with a new ``--master-port``
    where ``extra_args`` give one).  On exit the server gets SIGTERM (then SIGKILL)."""
    for attempt in range(3):
        args = extra_args if attempt == 0 else _new_master_port(extra_args)
        server = _launch(model_dir, args, env, free_port() if port is None else port)
        server.credentials = credentials
        try:
            server.wait_for(want_serving=wait_serving, timeout_s=timeout_s)
            break
        except BaseException as exc:
            logs = server.logs()
            server.discard()
            # Another process took the free port between free_port() and the bind: try
            # another one (only when the caller left the port to us).
            lost_race = isinstance(exc, ServerExited) and any(m in logs for m in _BIND_FAILURES)
            if port is not None or not lost_race or attempt == 2:
                print(f"--- genserve log ---\n{logs}", file=sys.stderr)
                raise
    try:
        yield server
    except BaseException:
        # pytest shows a failing test's stderr: the server's side of the story.
        print(f"--- genserve log ({server.log_path}) ---\n{server.logs()}", file=sys.stderr)
        raise
    finally:
        server.discard()


# What a genserve whose port was taken prints (grpc's own error, or server/app.py's; EADDRINUSE:
# torch.distributed's store on a sharded server's --master-port).
_BIND_FAILURES = ("Failed to bind to address", "cannot listen on", "EADDRINUSE")


def _new_master_port(args: tuple[str, ...]) -> tuple[str, ...]:
    """``args`` with another free ``--master-port`` (a retry after a lost port race)."""
    out = list(args)
    if "--master-port" in out:
        out[out.index("--master-port") + 1] = str(free_port())
    return tuple(out)


def _launch(
    model_dir: Path | str, extra_args: tuple[str, ...], env: Mapping[str, str] | None, port: int
) -> LiveServer:
    fd, log_name = tempfile.mkstemp(prefix="genserve-", suffix=".log")
    cmd = [
        *genserve_command(),
        "--model-id",
        str(model_dir),
        "--hostname",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    proc_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with os.fdopen(fd, "wb") as log_file:
        proc = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=proc_env
        )
    return LiveServer(proc, port, Path(log_name))
