"""A real OTLP/gRPC trace receiver, run as its own process: it implements the collector's
``opentelemetry.proto.collector.trace.v1.TraceService`` and appends every export it gets to a
file, so a test can read back exactly what genserve sent over the wire.

    python -m tests.utils.otlp_receiver OUT_FILE      # prints its port, then serves

Each line of OUT_FILE is one ``ExportTraceServiceRequest``, serialized and base64-encoded.
:class:`OtlpReceiver` starts the process and parses the file into :class:`ReceivedSpan`s."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self, out: Path) -> None:
        self._out = out
        self._lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        line = base64.b64encode(request.SerializeToString()) + b"\n"
        with self._lock, self._out.open("ab") as f:
            f.write(line)
        return trace_service_pb2.ExportTraceServiceResponse()


def main(out: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(Path(out)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(1).wait()


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    """A span as it arrived over OTLP (ids in W3C hex)."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any]


class OtlpReceiver:
    """The receiver process; ``endpoint`` is what genserve's ``--otlp-endpoint`` wants."""

    def __init__(self) -> None:
        fd, name = tempfile.mkstemp(prefix="otlp-", suffix=".b64")
        os.close(fd)  # the receiver process appends to it by name
        self.out = Path(name)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.utils.otlp_receiver", name],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[ReceivedSpan]:
        out: list[ReceivedSpan] = []
        for line in self.out.read_bytes().splitlines():
            request = trace_service_pb2.ExportTraceServiceRequest.FromString(base64.b64decode(line))
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for s in scope_spans.spans:
                        out.append(
                            ReceivedSpan(
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                start_ns=s.start_time_unix_nano,
                                end_ns=s.end_time_unix_nano,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                events=tuple(e.name for e in s.events),
                                status_code=s.status.code,
                                resource=resource,
                            )
                        )
        return out

    def wait_for(
        self, ready: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """Poll until ``ready(spans)``; AssertionError with what arrived after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if ready(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.name, s.trace_id) for s in spans)
                raise AssertionError(f"spans did not arrive in {timeout_s}s; got {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.unlink(missing_ok=True)


if __name__ == "__main__":
    main(sys.argv[1])
