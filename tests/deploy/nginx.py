"""A real nginx (Debian's package, installed by scripts/tools.sh) running
deploy/nginx/genserve-sidecar.conf.template in front of genserve replicas, for the proxy tests.

    with run_nginx(["127.0.0.1:50051", "127.0.0.1:50052"], tmp_path) as proxy:
        grpc.insecure_channel(proxy.address) ..."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.utils.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "deploy" / "nginx" / "genserve-sidecar.conf.template"


def nginx_binary() -> str | None:
    """nginx on PATH or where Debian puts it (/usr/sbin is not on every PATH)."""
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def render(listen: str, upstreams: Sequence[str], run_dir: Path) -> str:
    """The sidecar config with its ${VARS} filled, as envsubst would."""
    servers = "\n        ".join(f"server {u} max_fails=1 fail_timeout=5s;" for u in upstreams)
    values = {"NGINX_LISTEN": listen, "GENSERVE_UPSTREAMS": servers, "NGINX_RUN_DIR": str(run_dir)}
    # Only these three: $remote_addr and friends are nginx's own variables (envsubst is run
    # with the same list: envsubst '$NGINX_LISTEN $GENSERVE_UPSTREAMS $NGINX_RUN_DIR').
    return re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], TEMPLATE.read_text())


@dataclass
class Nginx:
    proc: subprocess.Popen[bytes]
    port: int
    run_dir: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def access_log(self) -> str:
        path = self.run_dir / "access.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def error_log(self) -> str:
        path = self.run_dir / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""


def _wait_listening(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"nginx exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError("nginx did not listen")


@contextmanager
def run_nginx(upstreams: Sequence[str], run_dir: Path) -> Iterator[Nginx]:
    binary = nginx_binary()
    assert binary is not None, "nginx is not installed (scripts/tools.sh installs it)"
    run_dir.mkdir(parents=True, exist_ok=True)
    run_dir.chmod(0o777)  # workers drop to nobody when the master runs as root
    port = free_port()
    conf = run_dir / "nginx.conf"
    conf.write_text(render(f"127.0.0.1:{port}", upstreams, run_dir))
    check = subprocess.run(
        [binary, "-t", "-c", str(conf), "-p", str(run_dir), "-e", str(run_dir / "error.log")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen(
        [binary, "-c", str(conf), "-p", str(run_dir), "-e", str(run_dir / "error.log"),
         "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        _wait_listening(port, proc)
        yield Nginx(proc, port, run_dir)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)  # graceful: finish calls in flight
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
