"""The engine loop in a process of its own (--engine-process, issue #29): start it, run it.

Why a process: on an H200 the gRPC event loop thread held the GIL ~70% of the wall time at
256 streams (a third of it in grpc's per-token ``context.write``), and the engine thread
(schedule, apply, detokenise) and the runner's step thread wait for that GIL.  A process
gives the engine its own interpreter.  vLLM splits the same way (AsyncLLM in the API
server, EngineCore in a busy-loop process, ZMQ + msgpack between them), SGLang too
(TokenizerManager / Scheduler / Detokenizer processes).

The split: the child runs what the engine thread runs in one process (scheduler, KV
cache, runner, detokenisers: :class:`~genserve.engine.engine_loop.EngineLoop` on an
:class:`~genserve.engine.engine_thread.EngineThread`); the gRPC process keeps the servicer,
validation, tokenisation of prompts, chat templates and the per-request mailboxes
(``engine/process_engine.py``).  Two one-way ``multiprocessing`` pipes carry pickled tuples
(``engine/step_wire.py``; pyzmq and msgspec are not in the environment, and a pipe needs
neither a port nor a socket file): requests and aborts one way, one message per step the
other way.  The child is started with **spawn** (CUDA does not survive a fork); it loads the
model itself through the launcher's ``load`` function, so this module never sees the
launcher's config.

In the child the main thread reads the request pipe (so the front never blocks on a full
pipe while a step runs) and posts to the engine thread; the engine thread sends each step's
message itself.  A request with a grammar or a LoRA adapter is prepared on the way, in a
worker thread (:class:`_Arrivals`): its grammar compiled from its spec, its adapter laid out
for the slot the front's adapter manager gave it.  The pipe's end-of-file is how the child
learns that the front is gone: it exits at once, no orphan holds the GPU.

With tensor parallelism the child is rank 0: it starts ranks 1..N-1 while it loads, as the
one-process server does (``worker/shard_processes.py``: their lifeline pipe is the child's,
so its exit, however it comes, ends them too).  A rank's death reaches the front through
:meth:`FrontLink.part_died`: before the hello it fails the launch, after it the front hears
``DEAD`` with the rank named and ends the server as after a shard failure in one process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import multiprocessing
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import structlog

from genserve.engine import step_wire as wire
from genserve.engine.engine_loop import Delivery, EngineLoop
from genserve.engine.engine_thread import EngineThread
from genserve.engine.outputs import GenerationRequest, scheduler_request
from genserve.engine.request import FinishReason
from genserve.engine.scheduler import Scheduler
from genserve.step import AdapterRef, Runner
from genserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    from genserve.engine.grammar import GrammarCompiler, GrammarState
    from genserve.engine.grammar_spec import GrammarSpec

log = structlog.get_logger(__name__)


class EngineStartError(RuntimeError):
    """The engine process exited before it served (its own error was lost)."""


class EnginePartDiedError(RuntimeError):
    """A part the engine process depends on (a tensor-parallel rank) died before it served;
    the message is the reason (``shard 1 (pid 4242) was killed by SIGKILL``)."""


@dataclass(slots=True)
class EngineProcess:
    """The front's handle: the child process and the two pipe ends the front holds."""

    process: multiprocessing.process.BaseProcess
    to_engine: Connection
    from_engine: Connection

    def wait_hello(self) -> wire.EngineHello:
        """Blocking: the child's hello once it serves; raises what its loading raised."""
        try:
            message = wire.loads(self.from_engine.recv_bytes())
        except (EOFError, OSError):
            self.process.join(5.0)
            raise EngineStartError(
                f"the engine process exited while loading (exit code {self.process.exitcode})"
            ) from None
        if message[0] == wire.FAILED:
            self.process.join(5.0)
            raise message[1]
        assert message[0] == wire.HELLO, message[0]
        hello = message[1]
        assert isinstance(hello, wire.EngineHello)
        return hello

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5.0)


def spawn_engine(target: Callable[..., None], *args: Any) -> EngineProcess:
    """Start ``target(*args, from_front, to_front)`` in a spawned process.  ``target`` must be
    importable by name (the launcher's child entry point)."""
    ctx = multiprocessing.get_context("spawn")
    engine_in, front_out = ctx.Pipe(duplex=False)  # front -> engine
    front_in, engine_out = ctx.Pipe(duplex=False)  # engine -> front
    process = ctx.Process(
        target=target, args=(*args, engine_in, engine_out), name="genserve-engine", daemon=False
    )
    process.start()
    # Only the child holds its ends now: its exit is an end-of-file here, ours one there.
    engine_in.close()
    engine_out.close()
    return EngineProcess(process, front_out, front_in)


# The child's exit code when loading failed or a part of the engine died before it served
# (the front reports the error it was sent; the launcher's shard-failure code is 1 too).
EXIT_LOAD_FAILED = 1


def _failure_message(exc: BaseException) -> bytes:
    try:
        data = wire.dumps((wire.FAILED, exc))
        wire.loads(data)  # some exceptions pickle but do not unpickle
    except Exception:
        data = wire.dumps((wire.FAILED, RuntimeError(f"{type(exc).__name__}: {exc}")))
    return data


class FrontLink:
    """Child: the pipe to the front, one writer at a time (engine thread: steps; main
    thread: replies; a shard's watcher thread: its death), and what the child says on it
    about its own fate: loading failed, serving (the hello), a part of the engine died."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        # Set with the hello, under _lock: a death is FAILED before it and DEAD after it,
        # never a DEAD the front reads before the hello.
        self._engine: tuple[EngineLoop, EngineThread] | None = None

    def send(self, data: bytes) -> None:
        # The front gone: the main thread's end-of-file ends the process.
        with self._lock:
            self._send_locked(data)

    def _send_locked(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self._conn.send_bytes(data)

    def send_failure(self, exc: BaseException) -> None:
        """Loading failed: the front raises ``exc`` (or its text, if it does not pickle)."""
        self.send(_failure_message(exc))

    def send_hello(self, hello: wire.EngineHello, core: EngineLoop, thread: EngineThread) -> None:
        with self._lock:
            self._engine = (core, thread)
            self._send_locked(wire.dumps((wire.HELLO, hello)))

    def part_died(self, reason: str) -> None:
        """A part the engine depends on died (a tensor-parallel rank: ``reason`` names it).
        Any thread.  Before the hello: the launch fails with ``reason``
        (:class:`EnginePartDiedError`) and this process exits now, its shard workers on
        their lifeline (the one-process launcher does not wait for such a load either).
        After it: the front hears ``DEAD`` first
        (its calls end UNAVAILABLE with the reason, it exits 1 as after a shard failure),
        then the engine fails its requests and stops stepping, as ``AsyncEngine.mark_dead``
        does in one process; the front then shuts this process down."""
        log.error("engine_part_died", reason=reason)
        with self._lock:
            engine = self._engine
            if engine is None:
                self._send_locked(_failure_message(EnginePartDiedError(reason)))
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_LOAD_FAILED)
            self._send_locked(wire.dumps((wire.DEAD, reason)))
        core, thread = engine
        # At once, ahead of the inbox, even while the loop awaits a step that never ends.
        if not thread.call_soon(functools.partial(core.die, reason)):
            log.warning("engine_thread_gone", reason=reason)


def serve_engine(
    scheduler: Scheduler,
    runner: Runner,
    tokenizer: Tokenizer,
    overlap: bool,
    grammars: GrammarCompiler | None,
    payload: Any,
    from_front: Connection,
    sender: FrontLink,
) -> None:
    """Child: run the engine loop until the front says shutdown or goes away.  Never
    returns: the process exits here (skipping interpreter teardown, as the launcher does).
    ``grammars``: the child's own compiler (None: --disable-grammar-support); ``sender``:
    the link loading used (a shard's death may be reported on it from any thread)."""

    def deliver(delivery: Delivery) -> None:  # engine thread, one call per step
        sender.send(wire.step_message(delivery, scheduler.stats(), core.num_steps))

    core = EngineLoop(scheduler, runner, tokenizer, deliver, overlap)
    thread = EngineThread()
    thread.on_drained = core.wake

    async def main() -> None:
        try:
            await core.run()
            reason = core.dead_reason or "the engine loop stopped"
        except asyncio.CancelledError:  # shutdown stops the loop
            raise
        except Exception as exc:  # a bug: the front must hear of it, not hang
            reason = f"the engine loop failed: {type(exc).__name__}: {exc}"
            log.exception("engine_loop_failed")
        sender.send(wire.dumps((wire.DEAD, reason)))

    thread.start(main)
    hello = wire.EngineHello(
        payload=payload,
        max_tokens_per_request=scheduler.max_tokens_per_request,
        overlap=core.overlap,
        schedule_ahead=core.schedule_ahead,
        pid=os.getpid(),
        stats=scheduler.stats(),
    )
    sender.send_hello(hello, core, thread)
    arrivals = _Arrivals(core, thread, tokenizer, grammars, sender)
    code = _read_front(from_front, sender, core, thread, arrivals)
    if code is None:  # the front is gone: nobody to stream to, free the device now
        log.warning("engine_process_orphaned", reason="the gRPC process closed its pipe")
        code = 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _read_front(
    conn: Connection, sender: FrontLink, core: EngineLoop, thread: EngineThread, arrivals: _Arrivals
) -> int | None:
    """The child's main thread: requests, aborts and queries from the front, until shutdown
    (returns 0) or the pipe's end (returns None)."""
    while True:
        try:
            message = wire.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        kind = message[0]
        if kind == wire.ADD:
            arrivals.add(message[1], message[2], message[3])
        elif kind == wire.ABORT:
            arrivals.abort(message[1])  # it sends the scheduler's stats after the abort
        elif kind == wire.COMPILE:
            arrivals.compile_ahead(message[1])
        elif kind == wire.QUERY:
            _query(message[1], message[2], sender, core, thread)
        elif kind == wire.SHUTDOWN:
            arrivals.shutdown()
            _shutdown(core, thread)
            return 0


class _Arrivals:
    """Child: the front's requests on their way to the engine thread.

    A request with a grammar or a LoRA adapter is prepared first, in a worker thread: its
    grammar compiled (from this process's cache after the first time: the front's compiled
    form does not cross, ``step_wire.add_message``), its adapter read and laid out for its
    slot (as the one-process engine does before it queues a request, so the step only copies
    tensors).  Meanwhile the main thread goes on reading the pipe and the engine thread on
    stepping; an abort that arrives before the preparation ends drops the request there.
    A preparation that fails ends that request (REJECT: the front answers it with the
    error), never the process."""

    def __init__(
        self,
        core: EngineLoop,
        thread: EngineThread,
        tokenizer: Tokenizer,
        grammars: GrammarCompiler | None,
        sender: FrontLink,
    ) -> None:
        self._core = core
        self._thread = thread
        self._tokenizer = tokenizer
        self._grammars = grammars
        self._sender = sender
        # Requests being prepared and those of them aborted meanwhile.  Guarded by _lock,
        # under which the posts to the engine thread are made too: an ABORT is posted after
        # its ADD, or the ADD is never posted.
        self._lock = threading.Lock()
        self._preparing: set[str] = set()
        self._aborted: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genserve-prepare")

    def add(
        self, req: GenerationRequest, spec: GrammarSpec | None, adapter: AdapterRef | None
    ) -> None:
        if spec is None and adapter is None:
            self._post_add(req, adapter, None)
            return
        with self._lock:
            self._preparing.add(req.req_id)
        self._pool.submit(self._prepare, req, spec, adapter)

    def abort(self, req_id: str) -> None:
        with self._lock:
            if req_id in self._preparing:
                self._aborted.add(req_id)
                return
            self._thread.post(functools.partial(self._core.abort, req_id))
        # The metrics read the stats of the last message: freed blocks show now, not at the
        # next step (there may be none for a while).
        scheduler = self._core.scheduler
        self._thread.post(lambda: self._sender.send(wire.dumps((wire.STATS, scheduler.stats()))))

    def compile_ahead(self, spec: GrammarSpec) -> None:
        """The front is compiling ``spec`` (a cache miss there): compile it here meanwhile,
        so the request that follows finds it in this process's cache instead of waiting
        for a second compile.  A spec the front then refuses fails here too, unseen."""
        if self._grammars is not None:
            self._pool.submit(self._compile_quietly, spec)

    def _compile_quietly(self, spec: GrammarSpec) -> None:
        assert self._grammars is not None
        with contextlib.suppress(Exception):  # the front reports it (INVALID_ARGUMENT)
            self._grammars.compile_sync(spec)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(
        self, req: GenerationRequest, spec: GrammarSpec | None, adapter: AdapterRef | None
    ) -> None:
        grammar: GrammarState | None = None
        error: str | None = None
        try:
            if spec is not None:
                grammar = self._grammar_state(spec)
            if adapter is not None:
                prepare = getattr(self._core.runner, "prepare_adapter", None)
                if prepare is not None:  # else the step that first runs it loads it
                    prepare(adapter)
        except Exception as exc:  # this request fails, not the engine
            what = "its grammar" if spec is not None and grammar is None else "its adapter"
            error = f"the engine process could not prepare {what}: {type(exc).__name__}: {exc}"
            log.warning("request_prepare_failed", req_id=req.req_id, error=error)
        with self._lock:
            self._preparing.discard(req.req_id)
            if req.req_id in self._aborted:
                self._aborted.discard(req.req_id)
                return
            if error is not None:
                self._sender.send(wire.dumps((wire.REJECT, req.req_id, error)))
                return
            self._post_add(req, adapter, grammar)

    def _grammar_state(self, spec: GrammarSpec) -> GrammarState:
        if self._grammars is None:  # the front has a compiler only when this process has one
            raise RuntimeError("structured output is disabled (--disable-grammar-support)")
        return self._grammars.compile_sync(spec).new_state()

    def _post_add(
        self, req: GenerationRequest, adapter: AdapterRef | None, grammar: GrammarState | None
    ) -> None:
        request = scheduler_request(req, adapter, grammar)
        detok = self._tokenizer.detokenizer(
            req.prompt_token_ids,
            req.stop,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str=req.include_stop_str_in_output,
        )
        self._thread.post(functools.partial(self._core.add, req, request, detok))


def _query(qid: int, name: str, sender: FrontLink, core: EngineLoop, thread: EngineThread) -> None:
    """Answer a query on the engine thread (between steps), reply from there."""
    queries: dict[str, Callable[[], Any]] = {
        "stats": core.scheduler.stats,
        "check_invariants": core.scheduler.check_invariants,
    }

    def run() -> None:
        try:
            value, ok = queries[name](), True
        except Exception as exc:
            value, ok = f"{type(exc).__name__}: {exc}", False
        sender.send(wire.dumps((wire.REPLY, qid, ok, value)))

    thread.post(run)


def _shutdown(core: EngineLoop, thread: EngineThread) -> None:
    """End every request (their outputs reach the front first), stop the loop and runner."""
    done = thread.call(lambda: core.fail_all(FinishReason.ABORTED, "server is shutting down"))
    try:
        done.result(30.0)
    except Exception:
        log.exception("engine_shutdown_abort_failed")
    thread.stop()
    try:
        core.runner.shutdown()
    except Exception:
        log.exception("runner_shutdown_failed")
    core.executor.shutdown(wait=False, cancel_futures=True)
