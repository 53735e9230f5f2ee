"""engine/heap.py: the start-up heap is frozen out of collections, and given back."""

from __future__ import annotations

import gc

from genserve.engine.heap import freeze_startup_heap, unfreeze_heap


def test_freeze_keeps_startup_objects_out_and_unfreeze_gives_them_back() -> None:
    before = gc.get_freeze_count()
    try:
        kept = [[i] for i in range(1000)]  # long-lived, tracked containers
        frozen = freeze_startup_heap()
        # Other threads of the test process (earlier tests' servers) may free frozen objects
        # meanwhile: the count can only fall after the freeze, never rise.
        assert frozen >= before + len(kept)
        assert gc.get_freeze_count() <= frozen
        # Garbage made after the freeze is still collected.
        cycle: list[object] = []
        cycle.append(cycle)
        del cycle
        assert gc.collect() >= 1
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0
