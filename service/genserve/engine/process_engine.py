"""The gRPC process's side of --engine-process: the facade the servicer talks to, with the
engine loop in another process (``engine/engine_process.py``).

Same interface as :class:`~genserve.engine.async_engine.AsyncEngine` where the servicer and
the launcher use it (generate, abort, is_ready, dead_reason, shutdown, step_observers, ...)
and the same per-request mailboxes, owned by the gRPC loop.  A request is checked here
(KV capacity, from the child's hello), then pickled to the child; the child builds its
scheduler request and detokeniser.  A reader thread receives one message per step, decodes
it off the event loop and hands it to the loop with one ``call_soon_threadsafe``, as the
engine thread's delivery does in one process; the loop fills the mailboxes and tells the
step observers.  The scheduler's stats come with every step (the metrics' scrape reads the
latest); :meth:`query` asks the child for fresh ones (tests).

When the child dies (the pipe's end-of-file while not shutting down) every request in flight
ends with an error while :attr:`dead_reason` is set (the servicer answers UNAVAILABLE) and
``on_death`` tells the launcher, which exits non-zero as after a shard failure.

Grammars and LoRA adapters work as in one process.  A grammar is compiled here first (the
servicer's converter: a bad one is INVALID_ARGUMENT before anything is sent) and its spec
crosses, the child compiling it again from its own cache.  Adapters are resolved, validated
and given their runner slot here, by the same :class:`~genserve.engine.adapter_manager.
AdapterManager` (an unknown one is NOT_FOUND, Info lists the resident ones); the request
carries its :class:`~genserve.step.AdapterRef` and the child's runner installs it.  With
tensor parallelism the child is rank 0 and starts the other ranks; a rank's death arrives as
``DEAD`` naming it, and ends the server as :attr:`dead_reason` / ``on_death`` say above."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

import structlog

from genserve.engine import step_wire as wire
from genserve.engine.adapter_manager import AdapterManager, acquire_requested
from genserve.engine.engine_loop import Delivery, StepObservation
from genserve.engine.engine_process import EngineProcess
from genserve.engine.grammar_spec import GrammarSpec
from genserve.engine.mailbox import RequestStream, deliver
from genserve.engine.outputs import GenerationRequest, scheduler_request
from genserve.engine.request import FinishReason
from genserve.engine.scheduler import check_request
from genserve.engine.scheduler_output import SchedulerStats
from genserve.engine.streaming import EngineUnavailableError, StreamingEngine
from genserve.step import AdapterRef

__all__ = ["ProcessEngine"]

log = structlog.get_logger(__name__)


class ProcessEngine(StreamingEngine):
    """Serves token streams per request from an engine loop running in a child process."""

    def __init__(
        self,
        engine: EngineProcess,
        hello: wire.EngineHello,
        on_death: Callable[[str], None] | None = None,
    ) -> None:
        self._engine = engine
        self._hello = hello
        self._on_death = on_death
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[str, RequestStream] = {}
        self._accepting = False
        self._stopping = False
        self._dead_reason: str | None = None
        self._idle = asyncio.Event()
        self._closed = asyncio.Event()  # the child's pipe reached its end
        self._drain_cut = False
        self._stats: SchedulerStats = hello.stats
        self._num_steps = 0
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._query_ids = itertools.count()
        self._reader: threading.Thread | None = None
        self.step_observers: list[Callable[[StepObservation], None]] = []
        # LoRA adapters (set by the launcher); None: requests naming an adapter are refused.
        self.adapters: AdapterManager | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start reading the child's messages and accept requests.  Call from the running
        event loop (the one that will call :meth:`generate`)."""
        self._loop = asyncio.get_running_loop()
        self._reader = threading.Thread(
            target=self._read, name="genserve-engine-reader", daemon=True
        )
        self._reader.start()
        self._accepting = True

    @property
    def pid(self) -> int:
        return self._hello.pid

    @property
    def overlap(self) -> bool:
        return self._hello.overlap

    @property
    def schedule_ahead(self) -> bool:
        return self._hello.schedule_ahead

    @property
    def is_ready(self) -> bool:
        return self._accepting and self._dead_reason is None and not self._closed.is_set()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def num_in_flight(self) -> int:
        return len(self._clients)

    @property
    def num_steps(self) -> int:
        """Steps the engine has applied, as of the last step message received."""
        return self._num_steps

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler's stats after the last step received (what the metrics' scrape
        reads: the scheduler itself is in the other process), or after the last abort."""
        return self._stats

    async def query(self, name: str) -> Any:
        """Ask the engine process: ``"stats"`` (fresh SchedulerStats) or
        ``"check_invariants"`` (raises RuntimeError on a broken invariant)."""
        if self._closed.is_set():
            raise EngineUnavailableError(self._dead_reason or "the engine process is gone")
        qid = next(self._query_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[qid] = future
        self._send((wire.QUERY, qid, name))
        return await future

    def stop_accepting(self) -> None:
        self._accepting = False

    def end_drain(self) -> None:
        self._drain_cut = True
        self._idle.set()

    def mark_dead(self, reason: str) -> None:
        """The engine process is gone (or must be): fail every request now.  gRPC loop."""
        self._accepting = False
        if self._dead_reason is None:
            self._dead_reason = reason
            log.error("engine_dead", reason=reason)
        self._end_all(FinishReason.ERROR, reason)

    async def shutdown(self, grace_s: float) -> None:
        """Let in-flight requests finish for up to ``grace_s``, then have the child end the
        rest (their outputs arrive first), stop and exit."""
        self._accepting = False
        if self._clients and self._dead_reason is None and not self._drain_cut:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, grace_s))
        if self._clients:
            log.warning("shutdown_aborting_requests", num_requests=len(self._clients))
        self._stopping = True
        if not self._closed.is_set():
            self._send((wire.SHUTDOWN,))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closed.wait(), 60.0)
        self._end_all(FinishReason.ABORTED, "server is shutting down")
        await asyncio.to_thread(self._engine.kill)

    # ----------------------------------------------------------------- requests
    async def _acquire_adapter(self, requested: str | None) -> AdapterRef | None:
        """The request's LoRA adapter, validated and pinned into a runner slot here (the
        child's runner reads and installs it: ``engine_process._Arrivals``)."""
        return await acquire_requested(self.adapters, requested)

    def _submit(self, req: GenerationRequest, adapter: AdapterRef | None) -> RequestStream:
        if not self.is_ready:  # the adapter's wait gave shutdown or a death time to come
            raise EngineUnavailableError(self._dead_reason or "the engine is not serving")
        check_request(scheduler_request(req, adapter), self._hello.max_tokens_per_request)
        client = RequestStream(req)
        self._clients[req.req_id] = client
        self._send(wire.add_message(req, adapter))
        return client

    def compile_ahead(self, spec: GrammarSpec) -> None:
        """The front's grammar compiler is about to compile ``spec`` (its cache missed): the
        engine process compiles it at the same time (``GrammarCompiler.on_compile``), so
        a new schema's first request waits for one compile, not one per process."""
        if not self._closed.is_set():
            self._send((wire.COMPILE, spec))

    def abort(self, req_id: str) -> None:
        client = self._clients.get(req_id)
        if client is None:
            return
        self._finish(req_id, client)
        if not self._closed.is_set():
            self._send((wire.ABORT, req_id))

    def _finish(self, req_id: str, client: RequestStream) -> None:
        client.finished = True
        del self._clients[req_id]
        if not self._clients:
            self._idle.set()

    def _send(self, message: tuple[Any, ...]) -> None:
        # The child gone: the reader's end-of-file reports it.
        with contextlib.suppress(OSError):
            self._engine.to_engine.send_bytes(wire.dumps(message))

    def _end_all(self, reason: FinishReason, message: str) -> None:
        for req_id, client in list(self._clients.items()):
            self._finish(req_id, client)
            client.queue.put_nowait(client.end_output(reason, message))

    # ----------------------------------------------------------------- the child's messages
    def _read(self) -> None:
        """Reader thread: receive and decode each message, hand it to the gRPC loop."""
        conn = self._engine.from_engine
        loop = self._loop
        assert loop is not None
        while True:
            try:
                message = wire.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            if message[0] == wire.STEP:
                delivery = wire.decode_delivery(message[1])
                handle: Callable[[], None] = _bind(self._on_step, delivery, message[2], message[3])
            else:
                handle = _bind(self._on_message, message)
            if not _post(loop, handle):
                return
        self._engine.process.join(5.0)
        code = self._engine.process.exitcode
        _post(loop, _bind(self._on_closed, code))

    def _on_step(self, delivery: Delivery, stats: SchedulerStats, num_steps: int) -> None:
        self._stats = stats
        self._num_steps = num_steps
        deliver(delivery, self._clients, self._finish, self.step_observers)

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == wire.REPLY:
            _, qid, ok, value = message
            future = self._replies.pop(qid, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(RuntimeError(value))
        elif kind == wire.STATS:
            self._stats = message[1]
        elif kind == wire.REJECT:  # the child could not start it (its grammar or adapter)
            _, req_id, error = message
            client = self._clients.get(req_id)
            if client is not None:
                self._finish(req_id, client)
                client.queue.put_nowait(client.end_output(FinishReason.ERROR, error))
        elif kind == wire.DEAD:
            self._die(str(message[1]))

    def _on_closed(self, exit_code: int | None) -> None:
        self._closed.set()
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineUnavailableError("the engine process is gone"))
        self._replies.clear()
        if not self._stopping:
            self._die(f"the engine process exited (exit code {exit_code})")

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self.mark_dead(reason)
        if self._on_death is not None:
            self._on_death(reason)


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> bool:
    if loop.is_closed():
        return False
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # closed meanwhile
        return False
    return True
