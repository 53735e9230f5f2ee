"""--engine-process, the child's arrivals (engine/engine_process.py ``_Arrivals``): a request
with a grammar or an adapter is prepared in a worker thread before it reaches the engine
thread; an abort that arrives meanwhile drops it (the engine never sees it); a preparation
that fails ends that request with a REJECT message, nothing else.

The engine loop, engine thread, tokenizer and compiler around it are recorders: what is
under test is the ordering and the messages, not generation (tests/e2e/test_engine_process.py
serves grammars and adapters end to end)."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from genserve.engine import step_wire as wire
from genserve.engine.engine_process import _Arrivals
from genserve.engine.grammar_spec import GrammarKind, GrammarSpec
from genserve.engine.outputs import GenerationRequest
from genserve.engine.request import StoppingCriteria
from genserve.step import AdapterRef, SamplingParams

SPEC = GrammarSpec(GrammarKind.REGEX, "[a-z]+")


@dataclass
class _Engine:
    """Stands in for the EngineLoop and the EngineThread: posts run at once, in order."""

    events: list[tuple[str, str]] = field(default_factory=list)
    runner: Any = None
    scheduler: Any = None

    def post(self, fn: Any) -> None:
        fn()

    def add(self, req: GenerationRequest, request: Any, detok: Any) -> None:
        grammar = "grammar" if request.grammar is not None else "plain"
        self.events.append(("add", f"{req.req_id}:{grammar}:{request.cache_salt}"))

    def abort(self, req_id: str) -> None:
        self.events.append(("abort", req_id))


class _Scheduler:
    def stats(self) -> str:
        return "stats"


class _Tokenizer:
    def detokenizer(self, *args: Any, **kwargs: Any) -> object:
        return object()


class _State:
    pass


class _Compiled:
    def new_state(self) -> _State:
        return _State()


class _Compiler:
    """Compiles after ``release`` is set; raises for the text "boom"."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.compiled: list[str] = []

    def compile_sync(self, spec: GrammarSpec) -> _Compiled:
        self.release.wait(10)
        self.compiled.append(spec.text)
        if spec.text == "boom":
            raise RuntimeError("xgrammar said no")
        return _Compiled()


class _Sender:
    def __init__(self) -> None:
        self.messages: list[tuple[Any, ...]] = []

    def send(self, data: bytes) -> None:
        self.messages.append(wire.loads(data))


def _arrivals(runner: Any = None) -> tuple[_Arrivals, _Engine, _Compiler, _Sender]:
    engine = _Engine(runner=runner, scheduler=_Scheduler())
    compiler, sender = _Compiler(), _Sender()
    arrivals = _Arrivals(engine, engine, _Tokenizer(), compiler, sender)  # type: ignore[arg-type]
    return arrivals, engine, compiler, sender


def _req(req_id: str) -> GenerationRequest:
    return GenerationRequest(
        req_id, (1, 2, 3), SamplingParams(), StoppingCriteria(max_new_tokens=4)
    )


def _wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_constrained_request_reaches_the_engine_once_compiled() -> None:
    arrivals, engine, compiler, sender = _arrivals()
    arrivals.add(_req("g"), SPEC, None)
    arrivals.add(_req("p"), None, None)  # a plain one does not wait behind the compile
    assert engine.events == [("add", "p:plain:None")]
    compiler.release.set()
    _wait_for(lambda: len(engine.events) == 2)
    assert engine.events[1] == ("add", "g:grammar:None")
    arrivals.abort("g")  # added: the engine aborts it
    assert engine.events[2] == ("abort", "g")
    assert sender.messages == [(wire.STATS, "stats")]
    arrivals.shutdown()


def test_an_abort_while_compiling_drops_the_request() -> None:
    arrivals, engine, compiler, sender = _arrivals()
    arrivals.add(_req("g"), SPEC, None)
    arrivals.abort("g")
    compiler.release.set()
    arrivals.add(_req("after"), SPEC, None)  # queued behind "g" in the worker
    _wait_for(lambda: engine.events)
    assert engine.events == [("add", "after:grammar:None")]  # "g" never reached the engine
    assert sender.messages == []
    arrivals.shutdown()


def test_a_failed_compile_rejects_that_request_only() -> None:
    arrivals, engine, compiler, sender = _arrivals()
    compiler.release.set()
    arrivals.add(_req("bad"), GrammarSpec(GrammarKind.REGEX, "boom"), None)
    arrivals.add(_req("good"), SPEC, None)
    _wait_for(lambda: engine.events and sender.messages)
    assert engine.events == [("add", "good:grammar:None")]
    ((kind, req_id, error),) = sender.messages
    assert (kind, req_id) == (wire.REJECT, "bad")
    assert "could not prepare its grammar" in error and "xgrammar said no" in error
    arrivals.shutdown()


def test_compile_ahead_runs_before_the_request_and_fails_quietly() -> None:
    """COMPILE (the front's cache missed): compiled at once in the worker, ahead of the ADD
    that follows; a spec that fails there (the front will refuse it) sends nothing."""
    arrivals, engine, compiler, sender = _arrivals()
    arrivals.compile_ahead(GrammarSpec(GrammarKind.REGEX, "boom"))
    arrivals.compile_ahead(SPEC)
    arrivals.add(_req("g"), SPEC, None)
    compiler.release.set()
    _wait_for(lambda: engine.events)
    assert compiler.compiled == ["boom", SPEC.text, SPEC.text]  # the last one: a cache hit
    assert engine.events == [("add", "g:grammar:None")]
    assert sender.messages == []
    arrivals.shutdown()


def test_an_adapter_is_prepared_before_its_request_is_added() -> None:
    prepared: list[AdapterRef] = []

    class Runner:
        def prepare_adapter(self, ref: AdapterRef) -> None:
            prepared.append(ref)
            if ref.adapter_id == "broken":
                raise ValueError("shapes do not fit")

    arrivals, engine, compiler, sender = _arrivals(Runner())
    compiler.release.set()
    ref = AdapterRef(0, "a1", "/adapters/a1")
    arrivals.add(_req("r"), None, ref)
    arrivals.add(_req("x"), None, AdapterRef(1, "broken", "/adapters/b"))
    _wait_for(lambda: engine.events and sender.messages)
    assert prepared[0] == ref
    assert engine.events == [("add", "r:plain:lora:a1")]  # the adapter salts the KV hashes
    ((kind, req_id, error),) = sender.messages
    assert (kind, req_id) == (wire.REJECT, "x") and "its adapter" in error
    arrivals.shutdown()


class _Process:
    """The child process as the front's EngineProcess sees it (never started here)."""

    exitcode = 0

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


def test_the_front_sends_the_spec_and_ends_a_rejected_request() -> None:
    """The front's side over real pipes: a constrained request's ADD carries its grammar's
    spec (not the compiled grammar); the child's REJECT ends that stream with ERROR and the
    child's message."""
    import dataclasses

    from genserve.bench.step_wire_cost import make_step
    from genserve.engine.engine_process import EngineProcess
    from genserve.engine.grammar import CompiledGrammar
    from genserve.engine.process_engine import ProcessEngine
    from genserve.engine.request import FinishReason

    async def main() -> None:
        front_in, engine_out = multiprocessing.Pipe(duplex=False)
        engine_in, front_out = multiprocessing.Pipe(duplex=False)
        hello = wire.EngineHello(None, 10_000, False, False, 0, make_step(1)[1])
        engine = ProcessEngine(EngineProcess(_Process(), front_out, front_in), hello)  # type: ignore[arg-type]
        engine.start()
        req = dataclasses.replace(_req("r1"), grammar=CompiledGrammar(SPEC, object()))
        stream = engine.generate(req)
        first = asyncio.ensure_future(anext(stream))
        message = wire.loads(await asyncio.to_thread(engine_in.recv_bytes))
        kind, sent, spec, adapter = message
        assert (kind, sent.req_id, sent.grammar, spec, adapter) == (
            wire.ADD,
            "r1",
            None,
            SPEC,
            None,
        )
        engine_out.send_bytes(wire.dumps((wire.REJECT, "r1", "could not prepare its grammar")))
        out = await asyncio.wait_for(first, 10)
        assert out.final is not None and out.token is None
        assert out.final.finish_reason is FinishReason.ERROR
        assert out.final.error == "could not prepare its grammar"
        assert engine.num_in_flight == 0

        def child_stops() -> None:  # as serve_engine does on SHUTDOWN: its pipe end closes
            assert wire.loads(engine_in.recv_bytes()) == (wire.SHUTDOWN,)
            engine_out.close()

        await asyncio.gather(engine.shutdown(0.0), asyncio.to_thread(child_stops))
        assert engine.dead_reason is None

    asyncio.run(main())
