"""The grammar bitmasks of one step: one packed row per sampling chunk of a constrained
request, filled for all of them in one call in the grammar thread while the forward runs
(a :class:`~genserve.engine.grammar.PendingBitmask`; the runner waits for it).  The grammar
machinery is imported on the first constrained step only, so unconstrained serving never
pays for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from genserve.step import ScheduledChunk

if TYPE_CHECKING:
    from genserve.engine.grammar import BitmaskFiller, GrammarState


class StepBitmasks:
    def __init__(self) -> None:
        self._filler: BitmaskFiller | None = None  # made on the first constrained step

    def submit(
        self,
        chunks: Sequence[ScheduledChunk],
        grammar_of: Callable[[str], GrammarState | None],
    ) -> tuple[object | None, tuple[str, ...]]:
        """``(pending bitmask or None, the req ids of its rows in order)``."""
        states = []
        req_ids = []
        for c in chunks:
            grammar = grammar_of(c.req_id)
            if c.sample and grammar is not None:
                states.append(grammar)
                req_ids.append(c.req_id)
        if not states:
            return None, ()
        if self._filler is None:
            from genserve.engine.grammar import BitmaskFiller  # only constrained steps pay

            self._filler = BitmaskFiller()
        return self._filler.submit(states), tuple(req_ids)
