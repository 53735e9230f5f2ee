"""EngineThread: the engine loop's own thread and asyncio loop (issue #29).

Posts run on the engine thread in posting order, a burst of posts wakes the loop once, a
failing item does not strand the ones behind it, ``call`` returns results and exceptions,
``call_soon`` runs ahead of a busy main task, and ``stop`` cancels ``main`` and joins."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from genserve.engine.engine_thread import EngineThread


def _started(main_done: list[str]) -> EngineThread:
    thread = EngineThread(name="test-engine")
    forever: dict[str, Any] = {}

    async def main() -> None:
        forever["event"] = asyncio.Event()
        try:
            await forever["event"].wait()
        finally:
            main_done.append("cancelled")

    thread.start(main)
    thread.call(lambda: None).result(5)  # main has started
    return thread


def test_posts_run_in_order_on_the_engine_thread_with_one_wake_up_per_burst() -> None:
    done: list[str] = []
    thread = _started(done)
    seen: list[tuple[int, str]] = []
    drains: list[int] = []
    thread.on_drained = lambda: drains.append(len(seen))
    gate = threading.Event()
    # Hold the engine loop so that the burst below queues up behind it.
    thread.call_soon(lambda: gate.wait(5) and None)
    for i in range(50):
        thread.post(lambda i=i: seen.append((i, threading.current_thread().name)))
    gate.set()
    thread.call(lambda: None).result(5)
    assert [i for i, _ in seen] == list(range(50))
    assert {name for _, name in seen} == {"test-engine"}
    assert drains[0] == 50  # the whole burst in one drain
    assert thread.is_running
    thread.stop()
    assert done == ["cancelled"] and not thread.is_running


def test_a_failing_item_does_not_strand_the_rest() -> None:
    thread = _started([])
    seen: list[int] = []

    def boom() -> None:
        raise RuntimeError("bad item")

    gate = threading.Event()
    thread.call_soon(lambda: gate.wait(5) and None)
    thread.post(boom)
    thread.post(lambda: seen.append(1))
    gate.set()
    with pytest.raises(ValueError, match="from the engine"):
        thread.call(lambda: (_ for _ in ()).throw(ValueError("from the engine"))).result(5)
    assert seen == [1]
    assert thread.call(lambda: 41 + 1).result(5) == 42
    thread.stop()


def test_call_without_a_running_thread_runs_inline() -> None:
    thread = EngineThread()
    assert thread.call(threading.current_thread).result(0) is threading.current_thread()
    assert not thread.call_soon(lambda: None)
    thread.stop()  # nothing to stop
