"""The real genserve-gateway binary (clients/go/cmd/genserve-gateway) as a test process."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.utils.live_server import free_port


def build_gateway(out: Path) -> Path:
    """`go build` the gateway into ``out`` (the Go toolchain comes from scripts/tools.sh)."""
    subprocess.run(
        ["go", "build", "-o", str(out), "./cmd/genserve-gateway"],
        cwd=Path(__file__).resolve().parents[2] / "clients" / "go",
        check=True,
        timeout=600,
    )
    return out


class Gateway:
    def __init__(self, url: str) -> None:
        self.url = url

    def request(
        self,
        method: str,
        path: str,
        body: Any | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def json(self, method: str, path: str, body: Any | None = None) -> tuple[int, Any]:
        status, _, raw = self.request(method, path, body)
        return status, json.loads(raw)


@contextmanager
def run_gateway(gateway_bin: Path, grpc_endpoint: str, *extra_args: str) -> Iterator[Gateway]:
    port = free_port()
    proc = subprocess.Popen(
        [
            str(gateway_bin),
            "--grpc-endpoint",
            grpc_endpoint,
            "--listen",
            f"127.0.0.1:{port}",
            *extra_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    gateway = Gateway(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                gateway.request("GET", "/healthz")
                break
            except OSError:
                assert time.monotonic() < deadline, "gateway did not listen"
                time.sleep(0.05)
        yield gateway
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
