"""genserve.v1.TextGenerationService: the RPCs, admission, streaming, cancellation, status codes.

Thin by design: each RPC converts its request in one call (server/conversion/), admits the
sequences, awaits the engine and hands the outputs to a renderer (server/generate_render.py,
server/chat_render.py).  Every way a call can end maps to one gRPC status with a message a
person can act on."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import structlog

from genserve.chat_template import ChatRenderer
from genserve.engine.async_engine import AsyncEngine
from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenOutput
from genserve.engine.process_engine import ProcessEngine
from genserve.engine.request import FinishReason
from genserve.engine.streaming import EngineUnavailableError
from genserve.model.adapter_errors import AdapterError, AdapterNotFoundError
from genserve.server.chat_render import ChatStreamAssembler, chat_response
from genserve.server.chat_reply import ChatFeatures
from genserve.server.conversion.convert import Conversion, RequestConverter
from genserve.server.conversion.errors import RequestError
from genserve.server.conversion.limits import Limits
from genserve.server.generate_render import Collected, generate_response, stream_message
from genserve.server.observe import RequestObserver, SequenceRecord, bind_call
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from genserve.engine.grammar import GrammarCompiler

log = structlog.get_logger(__name__)


class _CallFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# What the engine raises for a request it will not run (no token was generated).
_ENGINE_REFUSALS = (EngineUnavailableError, AdapterNotFoundError, AdapterError)


def _engine_failure(exc: Exception) -> _CallFailed:
    """The status an engine refusal (one of ``_ENGINE_REFUSALS``) maps to."""
    if isinstance(exc, EngineUnavailableError):
        return _CallFailed(grpc.StatusCode.UNAVAILABLE, str(exc))
    if isinstance(exc, AdapterNotFoundError):
        return _CallFailed(grpc.StatusCode.NOT_FOUND, str(exc))
    return _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and value:
            bind_call(value[:128])
            return value[:128]
    req_id = uuid.uuid4().hex
    bind_call(req_id)  # logs and the call's span carry it
    return req_id


@dataclass(frozen=True, slots=True)
class Serving:
    """What the servicer needs once the model is loaded."""

    engine: AsyncEngine | ProcessEngine  # ProcessEngine: --engine-process
    tokenizer: Tokenizer
    limits: Limits
    info: pb.InfoResponse
    max_concurrent_requests: int
    chat: ChatRenderer | None = None  # None: Chat answers FAILED_PRECONDITION
    grammars: GrammarCompiler | None = None  # None: --disable-grammar-support
    chat_features: ChatFeatures | None = None  # tool-call / reasoning parsers (#27)


class TextGenerationServicer(pb_grpc.TextGenerationServiceServicer):  # type: ignore[misc]
    """Registered before the model loads (so health probes get NOT_SERVING, not a refused
    connection); every RPC answers UNAVAILABLE until :meth:`attach` is called."""

    def __init__(self, observer: RequestObserver | None = None) -> None:
        self._serving: Serving | None = None
        self._converter: RequestConverter | None = None
        self._in_flight = 0
        self.observer = observer or RequestObserver()  # metrics, spans, request log lines

    def attach(self, serving: Serving) -> None:
        self._converter = RequestConverter(
            tokenizer=serving.tokenizer,
            limits=serving.limits,
            observer=self.observer,
            grammars=serving.grammars,
            chat_renderer=serving.chat,
            served_model_name=serving.info.served_model_name,
            model_id=serving.info.model_id,
            chat_features=serving.chat_features,
        )
        self._serving = serving

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def _require(self) -> Serving:
        if self._serving is None:
            raise _CallFailed(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self._serving

    # ------------------------------------------------------------------ helpers
    async def _convert(
        self, convert: Callable[[RequestConverter], Awaitable[Conversion]]
    ) -> Conversion:
        """Convert the request (server/conversion/) and admit its sequences; raises
        _CallFailed with the status the refusal names."""
        self._require()
        assert self._converter is not None
        try:
            conv = await convert(self._converter)
        except RequestError as exc:
            raise _CallFailed(exc.status, str(exc)) from None
        self._admit(len(conv.sequences))
        return conv

    def _admit(self, num_sequences: int) -> None:
        serving = self._require()
        if not serving.engine.is_ready:
            raise _CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                serving.engine.dead_reason or "the server is not serving (shutting down)",
            )
        limit = serving.max_concurrent_requests
        if self._in_flight + num_sequences > limit:
            raise _CallFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Model is overloaded: {self._in_flight} sequences in flight, limit "
                f"{limit} (--max-concurrent-requests); retry later",
            )

    def _failure_for(self, final: FinalInfo) -> _CallFailed | None:
        if final.finish_reason is FinishReason.ERROR:
            if self._require().engine.dead_reason is not None:
                return _CallFailed(grpc.StatusCode.UNAVAILABLE, final.error or "engine failed")
            return _CallFailed(grpc.StatusCode.INTERNAL, final.error or "generation failed")
        if final.finish_reason is FinishReason.ABORTED:
            return _CallFailed(grpc.StatusCode.UNAVAILABLE, final.error or "request aborted")
        return None

    async def _stream(self, req: GenerationRequest) -> AsyncGenerator[TokenOutput, None]:
        try:
            with self.observer.track(req) as record:
                async for out in self._require().engine.generate(req):
                    if out.final is not None:
                        self._check_final(record, out.final)
                    yield out
        except _ENGINE_REFUSALS as exc:
            raise _engine_failure(exc) from None

    def _check_final(self, record: SequenceRecord, final: FinalInfo) -> None:
        """Record the sequence's last output; raise the call's failure if it is one."""
        record.finished(final)
        failure = self._failure_for(final)
        if failure is not None:
            raise failure

    async def _collect_all(self, reqs: tuple[GenerationRequest, ...]) -> list[Collected]:
        """Generate admitted sequences concurrently (counted in flight meanwhile); raises the
        first _CallFailed.  A TaskGroup cancels the sibling sequences when one fails or the
        call is cancelled, so none keeps generating for a caller that is gone."""
        self._in_flight += len(reqs)
        failure: _CallFailed | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(r)) for r in reqs]
        except* _CallFailed as failures:
            failure = failures.exceptions[0]  # type: ignore[assignment]
        finally:
            self._in_flight -= len(reqs)
        if failure is not None:
            raise failure
        return [t.result() for t in tasks]

    async def _collect(self, req: GenerationRequest) -> Collected:
        collected = Collected()
        async for out in self._stream(req):
            if out.token is not None:
                collected.tokens.append(out.token)
                collected.top_tokens.append(out.top_tokens)
            if out.final is not None:
                collected.final = out.final
        return collected

    # ------------------------------------------------------------------ RPCs
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        try:
            conv = await self._convert(lambda c: c.generate(request, _request_id(context)))
            results = await self._collect_all(conv.sequences)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        return generate_response(conv, results, self._require().tokenizer.token_text)

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Writes each message with ``context.write`` (a coroutine handler, not an async
        generator): grpc.aio runs the same write per message either way, but the interceptors
        then wrap one coroutine per call instead of adding an async-generator hop per
        streamed token each (#29)."""
        try:
            conv = await self._convert(lambda c: c.generate_stream(request, _request_id(context)))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        self._in_flight += 1
        write = context.write
        req = conv.sequences[0]
        try:
            # What _stream does, written out here so the engine's output generator is the
            # only async-generator hop per streamed token (a hop is a frame resume on the
            # gRPC loop, whose every microsecond per token competes with the step's compute
            # threads on a small CPU: docs/benchmarks/cpu.md, 2026-11-27).
            with self.observer.track(req) as record:
                # aclosing: a cancellation that lands in write() leaves the engine's output
                # stream suspended at a yield; closing it now aborts the request at once
                # (its KV is freed) instead of when the generator is garbage-collected.
                async with contextlib.aclosing(self._require().engine.generate(req)) as outputs:
                    async for out in outputs:
                        if out.final is not None:
                            self._check_final(record, out.final)
                        await write(stream_message(conv, out))
        except _ENGINE_REFUSALS as exc:
            failure = _engine_failure(exc)
            await context.abort(failure.code, failure.message)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self._in_flight -= 1

    async def Health(
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        serving = self._serving
        if serving is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        elif not serving.engine.is_ready:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                serving.engine.dead_reason or "the server is not serving (shutting down)",
            )
        return pb.HealthResponse()

    async def Info(
        self, request: pb.InfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.InfoResponse:
        try:
            serving = self._require()
            adapters = serving.engine.adapters
            if adapters is None:
                return serving.info
            info = pb.InfoResponse()
            info.CopyFrom(serving.info)
            info.loaded_adapters.extend(adapters.loaded)  # changes as adapters come and go
            return info
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
            raise  # abort() raises; this keeps the type checker informed

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            tokenizer = self._require().tokenizer
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        spans = tokenizer.tokenize(request.inputs, add_special_tokens=add_special)
        return pb.TokenizeResponse(
            tokens=[
                pb.SimpleToken(id=s.token_id, text=s.text, start=s.start, stop=s.stop)
                for s in spans
            ]
        )

    # ------------------------------------------------------------------ chat
    async def Chat(
        self, request: pb.ChatRequest, context: grpc.aio.ServicerContext
    ) -> pb.ChatResponse:
        base_id = _request_id(context)
        try:
            conv = await self._convert(lambda c: c.chat(request, base_id))
            results = await self._collect_all(conv.sequences)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        assert conv.chat is not None
        return chat_response(conv.chat, base_id, results, self._require().tokenizer)

    async def ChatStream(
        self, request: pb.ChatStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ChatStreamResponse]:
        base_id = _request_id(context)
        try:
            conv = await self._convert(lambda c: c.chat(request, base_id))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        assert conv.chat is not None
        reqs = conv.sequences
        self._in_flight += len(reqs)
        assembler = ChatStreamAssembler(conv.chat, base_id, self._require().tokenizer)
        # Choices generate concurrently; their outputs meet in one queue, in arrival order.
        queue: asyncio.Queue[tuple[int, TokenOutput | None] | _CallFailed] = asyncio.Queue()

        async def pump(index: int, req: GenerationRequest) -> None:
            try:
                async for out in self._stream(req):
                    queue.put_nowait((index, out))
                queue.put_nowait((index, None))
            except _CallFailed as exc:
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        try:
            remaining = len(reqs)
            while remaining:
                item = await queue.get()
                if isinstance(item, _CallFailed):
                    await context.abort(item.code, item.message)
                    return
                index, out = item
                if out is None:
                    remaining -= 1
                    continue
                yield assembler.message(index, out)
        finally:
            # The caller is gone or the call failed: stop every choice (their KV is freed).
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._in_flight -= len(reqs)
