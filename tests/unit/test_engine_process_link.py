"""--engine-process, the child's link to the front (engine/engine_process.py ``FrontLink``):
a part of the engine dying after the hello (a tensor-parallel rank) reaches the front as
``DEAD`` naming it, before anything the dying engine sends, so the front ends its calls
UNAVAILABLE with that reason rather than the engine's ERROR outputs.  (Before the hello the
link exits the process: tests/e2e/test_engine_process_tensor_parallel.py kills a shard while
loading.)"""

from __future__ import annotations

import asyncio
import multiprocessing
from typing import Any

from genserve.engine import step_wire as wire
from genserve.engine.engine_process import FrontLink
from genserve.engine.engine_thread import EngineThread

REASON = "shard 1 (pid 4242) was killed by SIGKILL"


class _Core:
    """Stands in for the EngineLoop: its death sends what fail_all would (one message)."""

    def __init__(self, link: FrontLink) -> None:
        self.link = link
        self.died: list[str] = []

    def die(self, reason: str) -> None:
        self.died.append(reason)
        self.link.send(wire.dumps((wire.STATS, "after the death")))


def _hello() -> wire.EngineHello:
    return wire.EngineHello(None, 100, False, False, 1, stats=None)  # type: ignore[arg-type]


def test_a_death_after_the_hello_is_dead_first_then_the_engine_dies() -> None:
    front, child = multiprocessing.Pipe(duplex=False)
    link = FrontLink(child)
    core = _Core(link)
    thread = EngineThread()

    async def main() -> None:  # an engine loop that waits (a step that never ends)
        await asyncio.Event().wait()

    thread.start(main)
    try:
        link.send_hello(_hello(), core, thread)  # type: ignore[arg-type]
        link.part_died(REASON)
        messages: list[tuple[Any, ...]] = [wire.loads(front.recv_bytes()) for _ in range(3)]
    finally:
        thread.stop(5.0)
    assert [m[0] for m in messages] == [wire.HELLO, wire.DEAD, wire.STATS]
    assert messages[1][1] == REASON
    assert core.died == [REASON]  # ran on the engine thread while main was still awaiting
