"""genserve.v1.TextGenerationService: protobuf ↔ engine, streaming, cancellation, status codes.

Thin by design: validation lives in ``validation``, generation in the engine.  Every way a
call can end maps to one gRPC status with a message a person can act on."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import structlog

from genserve.engine.async_engine import AsyncEngine, EngineUnavailableError
from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason
from genserve.model.lora import AdapterError
from genserve.server.observe import RequestObserver, bind_call
from genserve.server.validation import (
    Limits,
    UnsupportedError,
    ValidationError,
    validate,
    validate_batch_size,
)
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from genserve.worker.adapters import AdapterNotFoundError

log = structlog.get_logger(__name__)

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
}


class _CallFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class _Collected:
    """A unary result assembled from the token stream."""

    tokens: list[TokenInfo] = field(default_factory=list)
    top_tokens: list[tuple[TokenInfo, ...]] = field(default_factory=list)
    final: FinalInfo | None = None


def _token_pb(t: TokenInfo) -> pb.Token:
    msg = pb.Token(id=t.token_id, text=t.text, special=t.special)
    if t.logprob is not None:
        msg.logprob = t.logprob
    return msg


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

    engine: AsyncEngine
    tokenizer: Tokenizer
    limits: Limits
    info: pb.InfoResponse
    max_concurrent_requests: int


class TextGenerationServicer(pb_grpc.TextGenerationServiceServicer):  # type: ignore[misc]
    """Registered before the model loads (so health probes get NOT_SERVING, not a refused
    connection); every RPC answers UNAVAILABLE until :meth:`attach` is called."""

    def __init__(self, observer: RequestObserver | None = None) -> None:
        self._serving: Serving | None = None
        self._in_flight = 0
        self.observer = observer or RequestObserver()  # metrics, spans, request log lines

    def attach(self, serving: Serving) -> None:
        self._serving = serving

    @property
    def num_in_flight(self) -> int:
        return self._in_flight

    def _require(self) -> Serving:
        if self._serving is None:
            raise _CallFailed(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self._serving

    # ------------------------------------------------------------------ helpers
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

    def _validate(self, req_id: str, text: str, params: pb.GenerateParameters) -> GenerationRequest:
        serving = self._require()
        try:
            return self.observer.validate(
                req_id,
                text,
                lambda: validate(req_id, text, params, serving.tokenizer, serving.limits),
            )
        except ValidationError as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except UnsupportedError as exc:
            raise _CallFailed(grpc.StatusCode.UNIMPLEMENTED, str(exc)) from None

    def _failure_for(self, final: FinalInfo) -> _CallFailed | None:
        if final.finish_reason is FinishReason.ERROR:
            if self._require().engine.dead_reason is not None:
                return _CallFailed(grpc.StatusCode.UNAVAILABLE, final.error or "engine failed")
            return _CallFailed(grpc.StatusCode.INTERNAL, final.error or "generation failed")
        if final.finish_reason is FinishReason.ABORTED:
            return _CallFailed(grpc.StatusCode.UNAVAILABLE, final.error or "request aborted")
        return None

    async def _stream(self, req: GenerationRequest) -> AsyncIterator[TokenOutput]:
        try:
            with self.observer.track(req) as record:
                async for out in self._require().engine.generate(req):
                    if out.final is not None:
                        record.finished(out.final)
                        failure = self._failure_for(out.final)
                        if failure is not None:
                            raise failure
                    yield out
        except EngineUnavailableError as exc:
            raise _CallFailed(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except AdapterNotFoundError as exc:
            raise _CallFailed(grpc.StatusCode.NOT_FOUND, str(exc)) from None
        except AdapterError as exc:
            raise _CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    async def _collect(self, req: GenerationRequest) -> _Collected:
        collected = _Collected()
        async for out in self._stream(req):
            if out.token is not None:
                collected.tokens.append(out.token)
                collected.top_tokens.append(out.top_tokens)
            if out.final is not None:
                collected.final = out.final
        return collected

    def _details(
        self, req: GenerationRequest, collected: _Collected, params: pb.GenerateParameters
    ) -> pb.Details:
        final = collected.final
        assert final is not None
        details = pb.Details(
            finish_reason=_FINISH_REASONS.get(final.finish_reason, pb.FINISH_REASON_UNSPECIFIED),
            generated_tokens=final.num_generated_tokens,
            input_length=final.num_prompt_tokens,
            cached_tokens=final.num_cached_tokens,
            prefill=[_token_pb(t) for t in final.prefill],
            tokens=[_token_pb(t) for t in collected.tokens],
        )
        if req.seed is not None:
            details.seed = req.seed
        if params.HasField("top_n_tokens") and params.top_n_tokens > 0:
            details.top_tokens.extend(
                pb.TopTokens(tokens=[_token_pb(t) for t in top]) for top in collected.top_tokens
            )
        return details

    # ------------------------------------------------------------------ RPCs
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        try:
            validate_batch_size(len(request.inputs), self._require().limits)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        base_id = _request_id(context)
        params = request.parameters
        num = len(request.inputs)
        try:
            reqs = [
                self._validate(base_id if num == 1 else f"{base_id}-{i}", text, params)
                for i, text in enumerate(request.inputs)
            ]
            self._admit(len(reqs))
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        self._in_flight += len(reqs)
        failure: _CallFailed | None = None
        try:
            # A TaskGroup cancels the sibling sequences when one fails or the call is
            # cancelled, so none keeps generating for a caller that is gone.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._collect(r)) for r in reqs]
        except* _CallFailed as failures:
            failure = failures.exceptions[0]  # type: ignore[assignment]
        finally:
            self._in_flight -= len(reqs)
        if failure is not None:
            await context.abort(failure.code, failure.message)
        results = [t.result() for t in tasks]
        response = pb.GenerateResponse()
        for text, req, collected in zip(request.inputs, reqs, results, strict=True):
            assert collected.final is not None
            generated = collected.final.generated_text
            result = pb.GenerateResult(
                generated_text=text + generated if params.return_full_text else generated
            )
            if params.details or params.decoder_input_details:
                result.details.CopyFrom(self._details(req, collected, params))
            response.results.append(result)
        return response

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        params = request.parameters
        try:
            req = self._validate(_request_id(context), request.inputs, params)
            self._admit(1)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        self._in_flight += 1
        try:
            async for out in self._stream(req):
                yield self._stream_message(request, req, out)
        except _CallFailed as exc:
            await context.abort(exc.code, exc.message)
        finally:
            self._in_flight -= 1

    def _stream_message(
        self, request: pb.GenerateStreamRequest, req: GenerationRequest, out: TokenOutput
    ) -> pb.GenerateStreamResponse:
        msg = pb.GenerateStreamResponse(index=out.index)
        if out.token is not None:
            msg.token.CopyFrom(_token_pb(out.token))
        msg.top_tokens.extend(_token_pb(t) for t in out.top_tokens)
        final = out.final
        if final is not None:
            text = final.generated_text
            msg.generated_text = (
                request.inputs + text if request.parameters.return_full_text else text
            )
            details = pb.StreamDetails(
                finish_reason=_FINISH_REASONS.get(
                    final.finish_reason, pb.FINISH_REASON_UNSPECIFIED
                ),
                generated_tokens=final.num_generated_tokens,
                input_length=final.num_prompt_tokens,
                cached_tokens=final.num_cached_tokens,
            )
            if req.seed is not None:
                details.seed = req.seed
            msg.details.CopyFrom(details)
        return msg

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
