"""genserve.server.interceptors on a real grpc.aio server: per-call metrics by the status the
client sees (OK, abort codes, exceptions, client cancellation, deadline), and server spans
that continue the caller's W3C trace context.

The handlers below stand in for the model (the interceptor must classify every way a call
can end, and a real model cannot be told to fail on cue); the gRPC server, the client, the
interceptor, the metrics registry and the OpenTelemetry SDK are the real ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from genserve.metrics import Metrics
from genserve.server.interceptors import ObservabilityInterceptor
from genserve.server.observe import bind_call
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"


class Behaviours(pb_grpc.TextGenerationServiceServicer):  # type: ignore[misc]
    """Generate/GenerateStream end the way the prompt says; ``sleeping`` is set once a
    ``sleep`` call is inside its handler (so a test cancels a call the server has, not one
    still on its way: on a loaded machine that takes longer than any fixed pause)."""

    def __init__(self) -> None:
        self.sleeping = asyncio.Event()

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        bind_call("req-" + request.inputs[0])
        match request.inputs[0]:
            case "invalid":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "`top_p` out of range")
            case "overloaded":
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded")
            case "unavailable":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "loading")
            case "boom":
                raise RuntimeError("kaboom")
            case "sleep":
                self.sleeping.set()
                await asyncio.sleep(30)
        return pb.GenerateResponse(results=[pb.GenerateResult(generated_text="done")])

    async def GenerateStream(
        self, request: pb.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        for i in range(3):
            yield pb.GenerateStreamResponse(index=i)
            if request.inputs == "sleep":
                await asyncio.sleep(30)


class Server:
    def __init__(
        self, metrics: Metrics, exporter: InMemorySpanExporter, behaviours: Behaviours
    ) -> None:
        self.metrics = metrics
        self.exporter = exporter
        self.behaviours = behaviours

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        text = generate_latest(self.metrics.registry).decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and s.labels == (labels or {}):
                    return float(s.value)
        raise KeyError(name)

    def failures(self, err: str) -> float:
        return self.value("genserve_request_failure_total", {"err": err})

    async def until(self, name: str, labels: dict[str, str], want: float) -> None:
        """Server-side accounting of a failed or cancelled call may finish after the client
        has its status (within milliseconds; the 30 s deadline is for a loaded machine)."""
        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline:
            if self.value(name, labels) == want:
                return
            await asyncio.sleep(0.01)
        assert self.value(name, labels) == want

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def provider() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


@pytest.fixture
async def served(
    provider: tuple[TracerProvider, InMemorySpanExporter],
) -> AsyncIterator[tuple[Server, pb_grpc.TextGenerationServiceStub, health_pb2_grpc.HealthStub]]:
    tracer_provider, exporter = provider
    metrics = Metrics()
    interceptor = ObservabilityInterceptor(metrics, tracer_provider.get_tracer("test"))
    server = grpc.aio.server(interceptors=[interceptor])
    behaviours = Behaviours()
    pb_grpc.add_TextGenerationServiceServicer_to_server(behaviours, server)
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        # Connected before the test starts: a short deadline then measures the call, not the
        # connection set-up.
        await asyncio.wait_for(channel.channel_ready(), 60)
        yield (
            Server(metrics, exporter, behaviours),
            pb_grpc.TextGenerationServiceStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )
    await server.stop(None)


Served = tuple[Server, pb_grpc.TextGenerationServiceStub, health_pb2_grpc.HealthStub]


def _gen(text: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs=[text])


async def test_success_counts_and_times(served: Served) -> None:
    srv, stub, _ = served
    await stub.Generate(_gen("ok"))
    async for _ in stub.GenerateStream(pb.GenerateStreamRequest(inputs="ok")):
        pass
    await srv.until("genserve_request_success_total", {}, 2)
    assert srv.value("genserve_request_count_total") == 2
    assert srv.value("genserve_request_duration_count") == 2
    assert all(srv.failures(err) == 0 for err in ("validation", "internal", "cancelled"))


@pytest.mark.parametrize(
    ("text", "code", "err"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "validation"),
        ("overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
        ("unavailable", grpc.StatusCode.UNAVAILABLE, "unavailable"),
        ("boom", grpc.StatusCode.UNKNOWN, "internal"),
    ],
)
async def test_failures_by_reason(
    served: Served, text: str, code: grpc.StatusCode, err: str
) -> None:
    srv, stub, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(_gen(text))
    assert info.value.code() == code
    # The interceptor finishes its accounting after the status reached the client.
    await srv.until("genserve_request_failure_total", {"err": err}, 1)
    assert srv.value("genserve_request_count_total") == 1
    assert srv.value("genserve_request_success_total") == 0
    assert srv.value("genserve_request_duration_count") == 0  # TGI: successes only
    (span,) = srv.spans()
    assert span.attributes["rpc.grpc.status_code"] == code.value[0]
    # Client mistakes and overload are not server errors (OpenTelemetry's gRPC conventions).
    server_fault = err in ("internal", "unavailable")
    assert (span.status.status_code is StatusCode.ERROR) == server_fault
    if err == "internal":
        assert any(e.name == "exception" for e in span.events)


async def test_deadline_and_cancellation(served: Served) -> None:
    srv, stub, _ = served
    # The deadline must pass while the handler runs (a call that expires on its way never
    # reaches the interceptor): 1 s is ample on a connected channel, even loaded, and the
    # handler sleeps 30 s.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Generate(_gen("sleep"), timeout=1.0)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert srv.behaviours.sleeping.is_set(), "the call expired before it reached the server"
    await srv.until("genserve_request_failure_total", {"err": "deadline"}, 1)

    srv.behaviours.sleeping.clear()
    call = stub.Generate(_gen("sleep"))
    await asyncio.wait_for(srv.behaviours.sleeping.wait(), 60)  # the server has the call
    call.cancel()
    await srv.until("genserve_request_failure_total", {"err": "cancelled"}, 1)

    stream = stub.GenerateStream(pb.GenerateStreamRequest(inputs="sleep"))
    assert (await stream.read()).index == 0
    stream.cancel()
    await srv.until("genserve_request_failure_total", {"err": "cancelled"}, 2)
    assert srv.value("genserve_request_success_total") == 0


async def test_server_span_continues_the_callers_trace(served: Served) -> None:
    srv, stub, health = served
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-01"), ("x-request-id", "abc"))
    await stub.Generate(_gen("ok"), metadata=metadata)
    (span,) = srv.spans()
    assert span.name == "genserve.v1.TextGenerationService/Generate"
    assert span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and span.parent.is_remote
    assert format(span.parent.span_id, "016x") == PARENT_ID
    assert span.attributes["rpc.system"] == "grpc"
    assert span.attributes["rpc.method"] == "Generate"
    assert span.attributes["rpc.grpc.status_code"] == 0
    assert span.attributes["genserve.req_id"] == "req-ok"  # set by the handler via bind_call

    # Without a traceparent a new trace starts; a caller that did not sample is honoured.
    await stub.Generate(_gen("ok"))
    await stub.Generate(_gen("ok"), metadata=(("traceparent", f"00-{TRACE_ID}-{PARENT_ID}-00"),))
    spans = srv.spans()
    assert len(spans) == 2
    assert spans[1].parent is None and format(spans[1].context.trace_id, "032x") != TRACE_ID

    # Health probes are not traced (and not counted as generation requests).
    await health.Check(health_pb2.HealthCheckRequest())
    assert len(srv.spans()) == 2
    assert srv.value("genserve_request_count_total") == 3


async def test_streaming_span_covers_the_whole_stream(served: Served) -> None:
    srv, stub, _ = served
    messages = [m async for m in stub.GenerateStream(pb.GenerateStreamRequest(inputs="ok"))]
    assert len(messages) == 3
    (span,) = srv.spans()
    assert span.name == "genserve.v1.TextGenerationService/GenerateStream"
    assert span.attributes["rpc.grpc.status_code"] == 0
