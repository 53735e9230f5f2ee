"""EngineLoop: a die() that arrives while an inline loop yields between steps ends the loop.

With steps run inline (CPU, no overlap) the loop yields once before it looks for work, so
that arrivals and aborts get in.  A die() let in by that yield sets the loop's wake-up and
fails every request; the loop must then stop rather than clear the spent wake-up and wait
for another that never comes (it hung before)."""

from __future__ import annotations

import asyncio
from typing import Any

from genserve.engine.engine_loop import EngineLoop


class _IdleScheduler:
    """No requests, ever: the loop's only way out is dead_reason."""

    def has_unfinished_requests(self) -> bool:
        return False

    def finish_requests(self, ids: list[str], reason: Any) -> None:
        assert ids == []


class _InlineRunner:
    steps_inline = True  # CPU-style: steps run on the engine thread

    def execute_model(self, step: Any) -> Any:  # never called: nothing is scheduled
        raise AssertionError("no step expected")


def test_die_during_the_inline_yield_ends_the_loop() -> None:
    async def main() -> None:
        delivered: list[Any] = []
        engine = EngineLoop(
            _IdleScheduler(),  # type: ignore[arg-type]
            _InlineRunner(),  # type: ignore[arg-type]
            tokenizer=None,  # type: ignore[arg-type]
            deliver=delivered.append,
        )
        assert engine.inline
        task = asyncio.create_task(engine.run())
        await asyncio.sleep(0)  # run() starts and yields at the top of its first look
        engine.die("runner gone")
        await asyncio.wait_for(task, timeout=10)  # hung forever before the fix
        assert engine.dead_reason == "runner gone"

    asyncio.run(main())
