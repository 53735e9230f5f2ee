"""OpenTelemetry traces, exported over OTLP/gRPC — only when ``--otlp-endpoint`` is given.

Without an endpoint :func:`configure_tracing` returns None and nothing here runs: no
provider, no exporter, no span objects (callers test ``tracer is None``).  With one, spans go
through a ``BatchSpanProcessor`` whose own thread does the export, so the event loop never
waits on the network.  The provider is private to the server (``trace.set_tracer_provider``
is not called): two servers in one process, or a host application with its own tracing,
do not interfere.

Incoming W3C ``traceparent``/``tracestate`` gRPC metadata continues the caller's trace; the
default sampler (parent-based, always on) honours the caller's sampled flag.

Spans are also built after the fact (:func:`retro_span`) from the monotonic timestamps the
engine observer records, so the engine loop creates no span objects while it runs."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.b3 import B3MultiFormat, B3SingleFormat
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

INSTRUMENTATION_NAME = "genserve"
# OTEL_PROPAGATORS names.  Both B3 flavours *read* the single ``b3`` header and the
# ``x-b3-*`` headers (Envoy/Istio send the latter); they differ only in what they write.
_PROPAGATORS: dict[str, type[TextMapPropagator]] = {
    "tracecontext": TraceContextTextMapPropagator,
    "baggage": W3CBaggagePropagator,
    "b3": B3SingleFormat,
    "b3multi": B3MultiFormat,
}
DEFAULT_PROPAGATORS: tuple[str, ...] = ("tracecontext", "baggage", "b3")
_PROPAGATOR: TextMapPropagator = CompositePropagator(
    [_PROPAGATORS[name]() for name in DEFAULT_PROPAGATORS]
)
# Offset from time.monotonic() to the Unix epoch, fixed once: spans built after the fact get
# wall-clock timestamps consistent with live spans (which the SDK stamps with time.time_ns()).
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


@dataclass(frozen=True, slots=True)
class Tracing:
    """A configured tracer and the provider behind it (flushed by :meth:`shutdown`)."""

    tracer: Tracer
    provider: Any  # opentelemetry.sdk.trace.TracerProvider

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter (bounded by the SDK's timeouts)."""
        self.provider.shutdown()


def configure_tracing(
    endpoint: str | None, service_name: str, service_version: str = ""
) -> Tracing | None:
    """A tracer exporting to the OTLP/gRPC collector at ``endpoint`` (``http://host:4317``;
    ``http`` means plaintext, ``https`` TLS), or None when ``endpoint`` is None or empty.

    The standard ``OTEL_*`` environment variables still apply (e.g. ``OTEL_BSP_SCHEDULE_DELAY``
    for the export interval, ``OTEL_EXPORTER_OTLP_HEADERS`` for authentication)."""
    if not endpoint:
        return None
    # Imported here: the SDK and the exporter are only loaded when tracing is on.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": service_name}
    if service_version:
        attributes["service.version"] = service_version
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    tracer = provider.get_tracer(INSTRUMENTATION_NAME, service_version or None)
    return Tracing(tracer=tracer, provider=provider)


def set_propagators(names: Iterable[str]) -> None:
    """Which trace headers incoming calls are continued from (``--otel-propagators`` /
    ``OTEL_PROPAGATORS``: tracecontext, baggage, b3, b3multi; ``none`` for none).  The first
    propagator that finds a valid parent wins in list order."""
    global _PROPAGATOR
    chosen = [name for name in names if name != "none"]
    unknown = sorted(set(chosen) - set(_PROPAGATORS))
    if unknown:
        raise ValueError(f"unknown propagators {unknown}; known: {sorted(_PROPAGATORS)}, none")
    _PROPAGATOR = CompositePropagator([_PROPAGATORS[name]() for name in chosen])


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context:
    """The caller's trace context from gRPC invocation metadata (empty if there is none):
    W3C ``traceparent``/``tracestate``/``baggage`` and B3 (``b3``, ``x-b3-*``) by default."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):  # binary (-bin) metadata carries no trace headers
            carrier[key] = value
    return _PROPAGATOR.extract(carrier)


def inject_context(span: Span) -> list[tuple[str, str]]:
    """``traceparent`` (and ``tracestate``) metadata that continues ``span``'s trace."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return sorted(carrier.items())


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as Unix-epoch nanoseconds (span timestamps)."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


def retro_span(
    tracer: Tracer,
    name: str,
    parent: Span,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
) -> Span:
    """A finished child span of ``parent`` over ``[start_s, end_s]`` (monotonic seconds)."""
    span = tracer.start_span(
        name,
        context=trace.set_span_in_context(parent),
        kind=SpanKind.INTERNAL,
        attributes=dict(attributes or {}),
        start_time=epoch_ns(start_s),
    )
    span.end(end_time=epoch_ns(max(start_s, end_s)))
    return span


def trace_ids(span: Span) -> tuple[str, str] | None:
    """(trace_id, span_id) in W3C hex, or None for a non-recording/invalid span."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
