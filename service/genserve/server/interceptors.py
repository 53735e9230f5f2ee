"""The grpc.aio server interceptor: one server span, per-call metrics and a failure log line
for every RPC of ``genserve.v1.TextGenerationService``.

* Traces (when a tracer is given): a SERVER span named after the RPC
  (``genserve.v1.TextGenerationService/Generate``) continuing the caller's W3C
  ``traceparent``, current while the handler runs, so the servicer's child spans and the log
  lines' ``trace_id``/``span_id`` hang off it.  OpenTelemetry's gRPC conventions:
  ``rpc.system``, ``rpc.service``, ``rpc.method``, ``rpc.grpc.status_code``; status ERROR only
  for server-side codes.
* Metrics (when given; Generate, GenerateStream, Chat, ChatStream): request count, success,
  failure by reason, duration of successful calls.
* How a call ended is read the way gRPC reports it: returned → OK; ``context.abort`` → its
  code; cancelled task or closed stream → DEADLINE_EXCEEDED when the deadline has passed,
  else CANCELLED; any other exception → UNKNOWN (an internal error).

Health checks and reflection pass through untouched: probes every few seconds would bury the
traces that matter.  Wrapping costs one extra coroutine per call for unary handlers and for
streaming handlers that write with ``context.write`` (GenerateStream), one async-generator
hop per streamed message for async-generator handlers; nothing per call blocks."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from genserve.metrics import Metrics
from genserve.server.observe import CALL_CONTEXT, cancel_reason
from genserve.tracing import extract_context

log = structlog.get_logger("genserve.requests")

SERVICE = "genserve.v1.TextGenerationService"
# Chat calls are generation calls too (TGI counts its chat route as a request).
GENERATION_METHODS = frozenset({"Generate", "GenerateStream", "Chat", "ChatStream"})

_REASONS = {
    grpc.StatusCode.INVALID_ARGUMENT: "validation",
    grpc.StatusCode.UNIMPLEMENTED: "validation",
    grpc.StatusCode.OUT_OF_RANGE: "validation",
    grpc.StatusCode.FAILED_PRECONDITION: "validation",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
}
# OpenTelemetry's gRPC server conventions: these codes are the server's fault.
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)


def failure_reason(code: grpc.StatusCode) -> str:
    """The ``err`` label of genserve_request_failure for a non-OK status code."""
    return _REASONS.get(code, "internal")


def final_code(
    context: grpc.aio.ServicerContext, exc: BaseException | None
) -> tuple[grpc.StatusCode, str]:
    """The status the client sees, and its message, for a handler that ended with ``exc``."""
    if exc is None or isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        if code is None:
            return grpc.StatusCode.OK, ""
        details = context.details()
        return code, details.decode() if isinstance(details, bytes) else details or ""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        if cancel_reason(context) == "deadline":
            return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    return grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"


@dataclass(slots=True)
class _Call:
    """One RPC being served."""

    method: str
    context: grpc.aio.ServicerContext
    started_s: float
    span: Span | None
    counted: bool  # a generation call: metrics apply


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """See the module docstring.  ``metrics`` and ``tracer`` may each be None."""

    def __init__(self, metrics: Metrics | None = None, tracer: Tracer | None = None) -> None:
        self.metrics = metrics
        self.tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        full_method: str = handler_call_details.method or ""
        service, _, method = full_method.lstrip("/").partition("/")
        if handler is None or service != SERVICE:
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(method, handler.unary_unary),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(method, handler.unary_stream),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler  # this service has no client-streaming RPCs

    # ------------------------------------------------------------------ wrappers
    def _wrap_unary(
        self, method: str, behavior: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]
    ) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = self._begin(method, context)
            try:
                response = await behavior(request, context)
            except BaseException as exc:
                self._end(call, exc)
                raise
            self._end(call, None)
            return response

        return handle

    def _wrap_stream(
        self,
        method: str,
        behavior: Callable[[Any, grpc.aio.ServicerContext], Any],
    ) -> Callable[[Any, grpc.aio.ServicerContext], Any]:
        if inspect.iscoroutinefunction(behavior):
            # A handler that streams with context.write (GenerateStream): one coroutine
            # per call wraps it, nothing per message (#29).
            return self._wrap_unary(method, behavior)

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = self._begin(method, context)
            try:
                async for message in behavior(request, context):
                    yield message
            except BaseException as exc:  # GeneratorExit: gRPC stopped reading (cancelled)
                self._end(call, exc)
                raise
            self._end(call, None)

        return handle

    # ------------------------------------------------------------------ begin / end
    def _begin(self, method: str, context: grpc.aio.ServicerContext) -> _Call:
        # Each RPC runs in an asyncio task with a context of its own (grpc.aio), so what is
        # set here is seen by the handler and ends with the call: no detach needed.
        CALL_CONTEXT.set(context)
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span(
                f"{SERVICE}/{method}",
                context=extract_context(context.invocation_metadata()),
                kind=SpanKind.SERVER,
                attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method},
            )
            otel_context.attach(trace.set_span_in_context(span))
        counted = self.metrics is not None and method in GENERATION_METHODS
        if counted:
            assert self.metrics is not None
            self.metrics.request_count.inc()
        return _Call(method, context, time.monotonic(), span, counted)

    def _end(self, call: _Call, exc: BaseException | None) -> None:
        code, message = final_code(call.context, exc)
        if call.counted:
            metrics = self.metrics
            assert metrics is not None
            if code is grpc.StatusCode.OK:
                metrics.request_success.inc()
                metrics.request_duration.observe(time.monotonic() - call.started_s)
            else:
                metrics.request_failure.labels(failure_reason(code)).inc()
        span = call.span
        if span is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code is not grpc.StatusCode.OK:
                span.set_attribute("genserve.status_message", message)
                if code in _SERVER_ERRORS:
                    span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
                if exc is not None and code is grpc.StatusCode.UNKNOWN:
                    span.record_exception(exc)
            span.end()
        if code is grpc.StatusCode.OK:
            return
        fields = {"method": call.method, "code": code.name, "message": message}
        if code is grpc.StatusCode.UNKNOWN:
            log.error("call_failed", **fields, exc_info=exc)
        elif call.counted and code not in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ):  # cancellations are logged per sequence by the observer
            log.info("call_failed", **fields)
