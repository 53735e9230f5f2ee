"""The asyncio facade the gRPC servicer talks to: many request streams over one engine loop.

The engine loop itself (schedule → run → apply tokens → stop checks → detokenise, in
``engine/engine_loop.py``) runs on a thread of its own with its own asyncio loop
(``engine/engine_thread.py``); the model runner's ``execute_model`` runs in a third
thread, the step thread.  This facade lives on the gRPC event loop: :meth:`AsyncEngine.
generate` validates a request here (errors reach the caller), posts it to the engine
thread's inbox and yields the request's outputs from its mailbox (``engine/mailbox.py``);
closing the iterator posts an abort.  The engine hands each step's outputs back in one batch
with one ``loop.call_soon_threadsafe`` (:meth:`AsyncEngine._deliver`), which fills the
request mailboxes and then tells the step observers (metrics, traces): observers run here, on the
gRPC loop, off the engine's critical path, and see steps in order.

Why a thread (issue #29): on an H200 the gRPC loop, which the engine loop used to share,
was ~30% busy serialising streams; every turn it took was a turn the engine loop waited
before handing the runner its next step.  vLLM runs its EngineCore busy loop in a process of
its own and its AsyncLLM output handler on the API server's loop; SGLang splits the
TokenizerManager (front end) from the Scheduler (own process).  A thread keeps genserve a
single process (no IPC, the runner's tensors stay put); the engine and gRPC threads still
share the GIL, so a busy gRPC loop can cost the engine thread Python time, but no longer a
place in a queue of callbacks.

State ownership: ``_clients`` (one queue per request) and the observers belong to the gRPC
loop; the scheduler and the streams' detokenisers to the engine thread (read the scheduler
through :meth:`call_in_engine`).  Outputs are identical to the single-loop engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import structlog

from genserve.engine.adapter_manager import AdapterManager, acquire_requested
from genserve.engine.engine_loop import Delivery, EngineLoop, StepObservation
from genserve.engine.engine_thread import EngineThread
from genserve.engine.mailbox import RequestStream, deliver
from genserve.engine.outputs import GenerationRequest, scheduler_request
from genserve.engine.request import FinishReason
from genserve.engine.scheduler import Scheduler
from genserve.engine.streaming import EngineUnavailableError, StreamingEngine
from genserve.step import AdapterRef, Runner
from genserve.tokenizer import Tokenizer

__all__ = ["AsyncEngine", "EngineUnavailableError", "StepObservation"]

log = structlog.get_logger(__name__)

T = TypeVar("T")


class AsyncEngine(StreamingEngine):
    """Serves token streams per request from an engine loop running on its own thread."""

    def __init__(
        self, scheduler: Scheduler, runner: Runner, tokenizer: Tokenizer, overlap: bool = False
    ) -> None:
        """``overlap``: schedule step n + 1 before step n's tokens are known and stream step
        n while step n + 1 runs (see ``engine/engine_loop.py``)."""
        self._runner = runner
        self._tokenizer = tokenizer
        self._core = EngineLoop(scheduler, runner, tokenizer, self._post_delivery, overlap)
        self._thread = EngineThread()
        self._thread.on_drained = self._core.wake
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[str, RequestStream] = {}
        self._accepting = False
        self._stopped = False
        self._idle = asyncio.Event()  # set whenever the last stream ends
        self._drain_cut = False  # end_drain: shutdown aborts in-flight requests at once
        self.step_observers: list[Callable[[StepObservation], None]] = []
        # LoRA adapters (set by the launcher); None: requests naming an adapter are refused.
        self.adapters: AdapterManager | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread and accept requests.  Call from the running event loop
        (the one that will call :meth:`generate`)."""
        self._loop = asyncio.get_running_loop()
        self._thread.start(self._core.run)
        self._accepting = True

    @property
    def overlap(self) -> bool:
        return self._core.overlap

    @property
    def schedule_ahead(self) -> bool:
        return self._core.schedule_ahead

    @property
    def is_ready(self) -> bool:
        """True when a request sent now would be generated."""
        return self._accepting and self._core.dead_reason is None and self._thread.is_running

    @property
    def dead_reason(self) -> str | None:
        return self._core.dead_reason

    @property
    def num_in_flight(self) -> int:
        return len(self._clients)

    @property
    def num_steps(self) -> int:
        """Steps whose results the engine has applied (any thread may read it)."""
        return self._core.num_steps

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler: owned by the engine thread, read it with :meth:`call_in_engine`."""
        return self._core.scheduler

    @property
    def engine_loop(self) -> asyncio.AbstractEventLoop | None:
        """The engine thread's event loop (None before :meth:`start`)."""
        return self._thread.loop

    def call_in_engine(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread (between steps); any thread may call it."""
        return self._thread.call(fn)

    def stop_accepting(self) -> None:
        self._accepting = False

    def end_drain(self) -> None:
        """Stop waiting for in-flight requests (a second SIGTERM/SIGINT): a shutdown under
        way, or the next one, aborts them now (their calls end UNAVAILABLE)."""
        self._drain_cut = True
        self._idle.set()

    def mark_dead(self, reason: str) -> None:
        """A part the engine depends on (a shard worker) is gone: fail every request now.

        Safe to call from any thread; runs at once on the engine thread, even while it
        awaits a step that will never end."""
        self._accepting = False
        if not self._thread.call_soon(functools.partial(self._core.die, reason)):
            self._core.die(reason)

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace_s``, abort the rest,
        stop the engine thread and the runner."""
        self._accepting = False
        if self._clients and self._core.dead_reason is None and not self._drain_cut:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, grace_s))
        if self._clients:
            log.warning("shutdown_aborting_requests", num_requests=len(self._clients))
            # Runs after the inbox (arrivals not yet added are added, then ended); its
            # delivery reaches this loop before the future's result does.
            await asyncio.wrap_future(
                self.call_in_engine(
                    lambda: self._core.fail_all(FinishReason.ABORTED, "server is shutting down")
                )
            )
        await asyncio.to_thread(self._thread.stop)
        self._stopped = True
        self._end_leftovers()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._runner.shutdown)
        self._core.executor.shutdown(wait=False, cancel_futures=True)

    def _end_leftovers(self) -> None:
        """Clients the stopped engine never answered (a delivery lost to a dead thread)."""
        for req_id, client in list(self._clients.items()):
            self._finish(req_id, client)
            client.queue.put_nowait(
                client.end_output(FinishReason.ABORTED, "server is shutting down")
            )

    # ----------------------------------------------------------------- requests
    async def _acquire_adapter(self, requested: str | None) -> AdapterRef | None:
        """The request's LoRA adapter pinned into a runner slot (loaded off the engine's
        critical path: validation runs in a thread while the batch keeps stepping)."""
        ref = await acquire_requested(self.adapters, requested)
        if ref is None or self.adapters is None:
            return None
        # Read and lay the adapter out for its slot in a thread now, so the step that first
        # runs it only copies tensors (a runner without the hook loads it on that step).
        prepare = getattr(self._runner, "prepare_adapter", None)
        if prepare is not None:
            try:
                await asyncio.to_thread(prepare, ref)
            except BaseException:
                self.adapters.release(ref)
                raise
        return ref

    def _submit(self, req: GenerationRequest, adapter: AdapterRef | None) -> RequestStream:
        """Register the request's mailbox and post it to the engine thread."""
        if not self.is_ready:  # the adapter's load gave shutdown or a failure time to come
            raise EngineUnavailableError(self.dead_reason or "the engine is not serving")
        grammar = req.grammar.new_state() if req.grammar is not None else None
        request = scheduler_request(req, adapter, grammar)
        self._core.scheduler.check_request(request)  # reads only the fixed KV capacity
        detok = self._tokenizer.detokenizer(
            req.prompt_token_ids,
            req.stop,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str=req.include_stop_str_in_output,
        )
        client = RequestStream(req)
        self._clients[req.req_id] = client
        self._thread.post(functools.partial(self._core.add, req, request, detok))
        return client

    def abort(self, req_id: str) -> None:
        """End a request now (cancellation, deadline); a no-op for unknown/finished ids."""
        client = self._clients.get(req_id)
        if client is None:
            return
        self._finish(req_id, client)
        if not self._stopped:
            self._thread.post(functools.partial(self._core.abort, req_id))

    def _finish(self, req_id: str, client: RequestStream) -> None:
        client.finished = True
        del self._clients[req_id]
        if not self._clients:
            self._idle.set()

    # ----------------------------------------------------------------- outputs
    def _post_delivery(self, delivery: Delivery) -> None:
        """Engine thread: one wake-up of the gRPC loop per delivery (one per step)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._deliver, delivery)

    def _deliver(self, delivery: Delivery) -> None:
        """gRPC loop: fill the request queues, then tell the observers."""
        deliver(delivery, self._clients, self._finish, self.step_observers)
