"""A request's outputs on their way to its stream: the mailbox the stream's generator drains
on the gRPC event loop, and the delivery of a step's outputs that fills the mailboxes.  Shared
by the in-process engine (``engine/async_engine.py``) and the ``--engine-process`` front
(``engine/process_engine.py``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from genserve.engine.engine_loop import Delivery, StepObservation
from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenOutput
from genserve.engine.request import FinishReason

__all__ = ["Mailbox", "RequestStream", "deliver"]


class Mailbox:
    """A request's outputs in arrival order: one consumer (the request's stream), puts from
    the gRPC loop only.  Cheaper per token than ``asyncio.Queue`` (no unfinished-task
    bookkeeping, no getter/putter deques, no loop lookup per call): one future at most per
    wait, and none while outputs are already waiting (#29)."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: collections.deque[TokenOutput] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, out: TokenOutput) -> None:
        self._items.append(out)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled: its consumer is going away
                waiter.set_result(None)

    async def get(self) -> TokenOutput:
        items = self._items
        while not items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None
        return items.popleft()


@dataclass(slots=True)
class RequestStream:
    """A request's output queue, owned by the gRPC loop."""

    request: GenerationRequest
    queue: Mailbox = field(default_factory=Mailbox)
    num_outputs: int = 0
    finished: bool = False

    def end_output(self, reason: FinishReason, message: str) -> TokenOutput:
        """The last output of a stream the engine will never answer (it stopped or died):
        no token, the reason and ``message`` as its error."""
        final = FinalInfo(
            finish_reason=reason,
            generated_text="",
            num_generated_tokens=self.num_outputs,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_cached_tokens=0,
            num_preemptions=0,
            error=message,
        )
        return TokenOutput(index=self.num_outputs, token=None, final=final)


def deliver(
    delivery: Delivery,
    clients: Mapping[str, RequestStream],
    finish: Callable[[str, RequestStream], None],
    observers: Sequence[Callable[[StepObservation], None]],
) -> None:
    """gRPC loop: put each output in its request's mailbox, in order, then tell the step
    observers.  An output whose request is no longer in ``clients`` (aborted while its step
    ran) is dropped; a final output first calls ``finish(req_id, stream)``, which removes the
    stream from ``clients``, so the stream is marked finished before its reader sees the end."""
    for req_id, out in delivery.outputs:
        client = clients.get(req_id)
        if client is None:  # aborted while its step was running
            continue
        client.num_outputs += out.token is not None
        if out.final is not None:
            finish(req_id, client)
        client.queue.put_nowait(out)
    if delivery.observation is not None:
        for observer in observers:
            observer(delivery.observation)
