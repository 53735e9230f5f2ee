"""What the in-process engine (``engine/async_engine.py``) and the ``--engine-process`` front
(``engine/process_engine.py``) share with their callers: a request's tokens streamed from
its mailbox, the request aborted when its stream is closed early, its LoRA adapter released
with the number of tokens it generated.  Each engine says how a request gets in
(:meth:`StreamingEngine._submit`) and out (:meth:`StreamingEngine.abort`)."""

from __future__ import annotations

import abc
from collections.abc import AsyncGenerator

from genserve.engine.adapter_manager import AdapterManager
from genserve.engine.mailbox import RequestStream
from genserve.engine.outputs import GenerationRequest, TokenOutput
from genserve.step import AdapterRef

__all__ = ["EngineUnavailableError", "StreamingEngine"]


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests: still loading, shutting down, or a shard died."""


class StreamingEngine(abc.ABC):
    """An engine whose callers read each request's outputs from its :class:`RequestStream`."""

    _clients: dict[str, RequestStream]
    # LoRA adapters (set by the launcher); None: requests naming an adapter are refused.
    adapters: AdapterManager | None

    @property
    @abc.abstractmethod
    def is_ready(self) -> bool:
        """Whether a new request is taken now."""

    @property
    @abc.abstractmethod
    def dead_reason(self) -> str | None:
        """Why the engine stopped serving for good, or None."""

    @abc.abstractmethod
    async def _acquire_adapter(self, requested: str | None) -> AdapterRef | None:
        """The request's adapter pinned into a runner slot (None: the base model)."""

    @abc.abstractmethod
    def _submit(self, req: GenerationRequest, adapter: AdapterRef | None) -> RequestStream:
        """Register the request's stream and hand the request to the engine loop."""

    @abc.abstractmethod
    def abort(self, req_id: str) -> None:
        """End a request early: it leaves the batch and its KV blocks return to the pool."""

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        """Yield the request's tokens as they are generated; the last output has ``final``.

        Closing the iterator early (client gone, deadline) aborts the request.  One
        async-generator layer between the request's mailbox and the caller: every layer
        costs the gRPC loop a frame resume per streamed token (#29)."""
        if not self.is_ready:
            raise EngineUnavailableError(self.dead_reason or "the engine is not serving")
        if req.req_id in self._clients:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        adapter = await self._acquire_adapter(req.adapter_id)
        num_generated = 0
        client: RequestStream | None = None
        try:
            client = self._submit(req, adapter)
            get = client.queue.get
            while True:
                out = await get()
                num_generated += out.token is not None
                yield out
                if out.final is not None:
                    return
        finally:
            if client is not None and not client.finished:
                self.abort(req.req_id)
            if adapter is not None and self.adapters is not None:
                self.adapters.release(adapter, num_generated)
