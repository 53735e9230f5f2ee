"""A real genserve server (real gRPC port, real model) running in this test process, in a
background thread with its own event loop, so tests can also look at engine internals
(free KV blocks) that no RPC exposes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from genserve.cli import Service
from genserve.config import environment_cache, load_config
from genserve.engine.async_engine import AsyncEngine
from genserve.kernels import int_dot

T = TypeVar("T")


class InProcessServer:
    def __init__(self, args: list[str]) -> None:
        # No other variable of this environment leaks in (MODEL_ID, PORT...), but its cache
        # does: the CPU kernels are built and found where GENSERVE_CACHE says.
        self.config = load_config(args, environ={"GENSERVE_CACHE": str(environment_cache())})
        # The launcher sets the process-wide --cpu-int-dot mode; the tests that run after this
        # one in the same process get the mode back that they had.
        self._int_dot_mode = int_dot.mode()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.service: Service = self.call(self._make)
        self.port = self.run(self.service.start())
        self.run(self.service.wait_ready(), timeout=600)

    def _make(self) -> Service:
        return Service(self.config)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def engine(self) -> AsyncEngine:
        engine = self.service.engine
        assert isinstance(engine, AsyncEngine), "an --engine-process server: see service.engine"
        return engine

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's event loop thread (the gRPC side: request streams,
        step observers)."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())  # type: ignore[no-any-return]

    def in_engine(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread (where the scheduler lives)."""
        return self.engine.call_in_engine(fn).result(120)

    def num_free_blocks(self) -> int:
        stats = self.in_engine(self.engine.scheduler.stats)
        return stats.num_total_blocks - stats.num_used_blocks

    def num_total_blocks(self) -> int:
        return self.in_engine(lambda: self.engine.scheduler.stats().num_total_blocks)

    def wait_all_blocks_free(self, timeout: float = 10.0) -> None:
        """Wait until no KV block is in use (ended requests have returned theirs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.num_free_blocks() == self.num_total_blocks():
                return
            time.sleep(0.05)
        in_use = self.num_total_blocks() - self.num_free_blocks()
        raise AssertionError(f"{in_use} KV blocks still in use")

    def stop(self) -> None:
        try:
            self.run(self.service.stop(), timeout=120)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            int_dot.configure(self._int_dot_mode)


@contextmanager
def inproc_server(model_dir: Path, *extra: str) -> Iterator[InProcessServer]:
    args = ["--model-id", str(model_dir), "--hostname", "127.0.0.1", "--port", "0", *extra]
    server = InProcessServer(args)
    try:
        yield server
    finally:
        server.stop()
