"""A dedicated thread running its own asyncio loop: where the engine loop lives (issue #29).

The gRPC server's event loop hands work to this thread through :meth:`EngineThread.post`: a
thread-safe inbox (a ``deque``, whose ``append``/``popleft`` are atomic) drained on the
engine's loop; a burst of posts costs one wake-up of the engine loop (one
``call_soon_threadsafe``), not one per request.  :meth:`call` runs a function on the engine
thread and returns a ``concurrent.futures.Future`` (shutdown, the metrics' scrape, tests);
:meth:`call_soon` runs one at once, ahead of the inbox (a dead shard failing every request
while a step is still awaited).

Nothing here knows about requests: it owns a thread, a loop and the task running ``main``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")


class EngineThread:
    """One daemon thread running an asyncio loop and, on it, the task ``main()``.

    The loop keeps running after ``main`` returns (an engine that died still answers
    :meth:`post` and :meth:`call`) until :meth:`stop`."""

    def __init__(self, name: str = "genserve-engine") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._inbox: deque[Callable[[], None]] = deque()
        self._drain_pending = False
        self.on_drained: Callable[[], None] | None = None  # runs after each inbox drain

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The engine's event loop (None before :meth:`start`)."""
        return self._loop

    @property
    def is_running(self) -> bool:
        """True while ``main`` runs."""
        return self._task is not None and not self._task.done()

    def start(self, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Start the thread and ``main`` on its loop; returns once the task exists."""
        if self._thread is not None:
            return
        ready = threading.Event()
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._task = loop.create_task(main(), name=f"{self._name}-loop")
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._loop = loop
        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        ready.wait()

    def post(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` to run on the engine thread, in posting order.  Any thread."""
        self._inbox.append(fn)
        # Ask for a drain unless one is already queued.  The drain clears the flag before it
        # pops, so an item appended after its last pop always finds the flag clear.
        if not self._drain_pending:
            self._drain_pending = True
            if not self.call_soon(self._drain):
                self._drain_pending = False

    def _drain(self) -> None:
        self._drain_pending = False
        inbox = self._inbox
        while inbox:
            try:
                inbox.popleft()()
            except Exception:  # one bad item must not strand the ones behind it
                log.exception("engine_inbox_item_failed")
        if self.on_drained is not None:
            self.on_drained()

    def call_soon(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the engine loop as soon as it is free (not behind the inbox).  Any
        thread.  False when the loop is not running (not started, or stopped)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return False
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:  # closed between the check and the call
            return False
        return True

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the engine thread, after everything posted before; its result or
        exception comes back in the future.  Any thread.  When the loop is not running (not
        started or stopped) ``fn`` runs in the calling thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        if self._thread is None or not self._thread.is_alive():
            run()
        else:
            self.post(run)
        return future

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel ``main``, stop the loop and join the thread.  Blocking: call it from a
        thread other than the engine's (``asyncio.to_thread``)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return

        def halt() -> None:
            assert self._loop is not None
            if self._task is not None and not self._task.done():
                self._task.cancel()
                # Let the cancellation run before the loop stops.
                self._task.add_done_callback(lambda _t: self._loop.stop() if self._loop else None)
            else:
                self._loop.stop()

        if self.call_soon(halt):
            thread.join(timeout_s)
