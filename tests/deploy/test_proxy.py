"""genserve behind a real nginx gRPC sidecar (deploy/nginx/genserve-sidecar.conf.template,
grpc_pass over h2c): what a mesh sidecar in the loop must not change or break."""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from genserve.client import Client
from genserve.client.errors import status_of
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.deploy.nginx import Nginx, nginx_binary, run_nginx
from tests.utils.live_server import LiveServer, free_port, start_server
from tests.utils.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.skipif(
    nginx_binary() is None,
    reason="nginx is not installed and scripts/tools.sh could not install it (needs root + apt)",
)

SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
PROMPT = "The quick brown fox"


@dataclass
class Proxied:
    server: LiveServer
    proxy: Nginx
    receiver: OtlpReceiver
    metrics_port: int

    def metric(self, name: str, labels: str = "") -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + labels + " ") or line.startswith(name + labels + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(name + labels)

    def wait_blocks_free(self, timeout_s: float = 20.0) -> float:
        deadline = time.monotonic() + timeout_s
        used = self.metric("genserve_kv_cache_blocks_used")
        while used and time.monotonic() < deadline:
            time.sleep(0.1)
            used = self.metric("genserve_kv_cache_blocks_used")
        return used


@pytest.fixture(scope="module")
def proxied(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    receiver = OtlpReceiver()
    metrics_port = free_port()
    args = (
        "--prometheus-port", str(metrics_port),
        "--otlp-endpoint", receiver.endpoint,
        "--json-output",
        "--max-batch-total-tokens", "8192",
    )  # fmt: skip
    try:
        with (
            start_server(tiny_model, *args, env={"OTEL_BSP_SCHEDULE_DELAY": "100"}) as server,
            run_nginx([server.address], tmp_path_factory.mktemp("nginx")) as proxy,
        ):
            yield Proxied(server, proxy, receiver, metrics_port)
    finally:
        receiver.stop()


def _stub(address: str) -> tuple[grpc.Channel, pb_grpc.TextGenerationServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.TextGenerationServiceStub(channel)


def _greedy(max_new_tokens: int) -> pb.GenerateParameters:
    return pb.GenerateParameters(max_new_tokens=max_new_tokens, do_sample=False)


def test_unary_and_streaming_pass_through_unchanged(proxied: Proxied) -> None:
    direct_channel, direct = _stub(proxied.server.address)
    proxy_channel, proxy = _stub(proxied.proxy.address)
    with direct_channel, proxy_channel:
        request = pb.GenerateRequest(inputs=[PROMPT, "Hello"], parameters=_greedy(8))
        assert proxy.Generate(request, timeout=60) == direct.Generate(request, timeout=60)
        stream_request = pb.GenerateStreamRequest(inputs=PROMPT, parameters=_greedy(8))
        via_proxy = list(proxy.GenerateStream(stream_request, timeout=60))
        via_direct = list(direct.GenerateStream(stream_request, timeout=60))
    assert len(via_proxy) == len(via_direct) > 1
    assert [(m.token.id, m.token.text) for m in via_proxy] == [
        (m.token.id, m.token.text) for m in via_direct
    ]
    assert via_proxy[-1].generated_text == via_direct[-1].generated_text


def test_error_statuses_and_messages_pass_through_unchanged(proxied: Proxied) -> None:
    bad_requests = [
        pb.GenerateRequest(inputs=["x"] * 50, parameters=_greedy(4)),  # > max client batch
        pb.GenerateRequest(inputs=[PROMPT], parameters=pb.GenerateParameters(top_p=7.0)),
        pb.GenerateRequest(inputs=[]),
    ]
    direct_channel, direct = _stub(proxied.server.address)
    proxy_channel, proxy = _stub(proxied.proxy.address)
    with direct_channel, proxy_channel:
        for request in bad_requests:
            outcomes = []
            for stub in (direct, proxy):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Generate(request, timeout=30)
                outcomes.append((info.value.code(), info.value.details()))
            assert outcomes[0] == outcomes[1], outcomes
            assert outcomes[0][0] == grpc.StatusCode.INVALID_ARGUMENT
        # A streaming error after the stream started is the same too.
        stream_request = pb.GenerateStreamRequest(inputs="", parameters=_greedy(4))
        for stub in (direct, proxy):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.GenerateStream(stream_request, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grpc_status=3" in proxied.proxy.access_log()


def test_client_cancel_mid_stream_frees_the_kv_blocks(proxied: Proxied) -> None:
    assert proxied.wait_blocks_free() == 0
    cancelled_before = proxied.metric("genserve_request_failure_total", '{err="cancelled"}')
    channel, stub = _stub(proxied.proxy.address)
    with channel:
        request = pb.GenerateStreamRequest(
            inputs=PROMPT * 20,
            parameters=pb.GenerateParameters(max_new_tokens=1000),
        )
        call = stub.GenerateStream(request, timeout=120)
        for _, _message in zip(range(3), call, strict=False):
            pass
        used_mid_stream = proxied.metric("genserve_kv_cache_blocks_used")
        call.cancel()
    assert used_mid_stream > 0
    assert proxied.wait_blocks_free() == 0, "KV blocks still held after the client cancelled"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proxied.metric("genserve_request_failure_total", '{err="cancelled"}') > cancelled_before:
            break
        time.sleep(0.1)
    assert (
        proxied.metric("genserve_request_failure_total", '{err="cancelled"}')
        == cancelled_before + 1
    )


def test_grpc_timeout_deadline_propagates_through_the_proxy(proxied: Proxied) -> None:
    """The server itself ends the call with DEADLINE_EXCEEDED (its metric says "deadline", not
    "cancelled"): grpc-timeout reached genserve through nginx."""
    assert proxied.wait_blocks_free() == 0
    before = proxied.metric("genserve_request_failure_total", '{err="deadline"}')
    channel, stub = _stub(proxied.proxy.address)
    with channel:
        # ignore_eos and a budget near the context: the call must outlive its 1 s deadline on
        # any machine (the random tiny model can emit EOS early, and a fast CPU decodes 1,000
        # tokens of it in under a second).
        request = pb.GenerateStreamRequest(
            inputs=PROMPT,
            parameters=pb.GenerateParameters(max_new_tokens=4000, ignore_eos=True),
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stub.GenerateStream(request, timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proxied.metric("genserve_request_failure_total", '{err="deadline"}') > before:
            break
        time.sleep(0.1)
    assert proxied.metric("genserve_request_failure_total", '{err="deadline"}') == before + 1
    assert proxied.wait_blocks_free() == 0


def _server_span(receiver: OtlpReceiver, trace_id: str) -> ReceivedSpan:
    spans = receiver.wait_for(
        lambda spans: any(s.trace_id == trace_id and s.kind == SERVER_KIND for s in spans)
    )
    (span,) = (s for s in spans if s.trace_id == trace_id and s.kind == SERVER_KIND)
    return span


@pytest.mark.parametrize("style", ["traceparent", "b3multi", "b3single"])
def test_trace_context_from_the_mesh_is_continued(proxied: Proxied, style: str) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    metadata = {
        "traceparent": (("traceparent", f"00-{trace_id}-{parent_id}-01"),),
        "b3multi": (
            ("x-b3-traceid", trace_id),
            ("x-b3-spanid", parent_id),
            ("x-b3-sampled", "1"),
        ),
        "b3single": (("b3", f"{trace_id}-{parent_id}-1"),),
    }[style]
    channel, stub = _stub(proxied.proxy.address)
    with channel:
        request = pb.GenerateRequest(inputs=["Hi"], parameters=_greedy(2))
        stub.Generate(request, timeout=60, metadata=metadata)
    span = _server_span(proxied.receiver, trace_id)
    assert span.parent_span_id == parent_id


def test_logs_carry_the_request_id(proxied: Proxied) -> None:
    channel, stub = _stub(proxied.proxy.address)
    with channel:
        request = pb.GenerateRequest(inputs=["Hi"], parameters=pb.GenerateParameters(top_p=9.0))
        with pytest.raises(grpc.RpcError):
            stub.Generate(request, timeout=30, metadata=(("x-request-id", "mesh-req-42"),))
        with pytest.raises(grpc.RpcError):
            stub.Generate(request, timeout=30)  # no id: nginx makes one ($request_id)
    # Both ids reach genserve's log lines as req_id: the caller's, and the one nginx made up
    # ($request_id, 32 hex) for the call without one.  Log lines may land just after the status.
    deadline = time.monotonic() + 10
    while True:
        access = proxied.proxy.access_log()
        made_up = {
            line.split("request_id=")[1].split()[0]
            for line in access.splitlines()
            if "request_id=" in line and "mesh-req" not in line
        }
        lines = [json.loads(x) for x in proxied.server.logs().splitlines() if x.startswith("{")]
        req_ids = {line.get("req_id") for line in lines if line.get("event") == "call_failed"}
        done = "mesh-req-42" in req_ids and "request_id=mesh-req-42" in access
        if (done and made_up & req_ids) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "request_id=mesh-req-42" in access
    assert "mesh-req-42" in req_ids
    assert made_up & req_ids and all(len(i) == 32 for i in made_up & req_ids)


def test_sigterm_one_of_two_replicas_drains_and_traffic_moves(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Streams in flight on the replica that gets SIGTERM finish; new calls go to the other
    one; nothing fails except with UNAVAILABLE (what meshes retry)."""
    args = ("--prometheus-port", "0", "--shutdown-timeout", "60", "--max-concurrent-requests", "64")
    with (
        start_server(tiny_model, *args) as first,
        start_server(tiny_model, *args) as second,
        run_nginx([first.address, second.address], tmp_path_factory.mktemp("nginx2")) as proxy,
    ):
        channel, stub = _stub(proxy.address)
        # Long enough to still be generating when SIGTERM lands (a 60-token stream of the
        # tiny model can end before that on a fast machine, and then nothing drains).
        long_request = pb.GenerateStreamRequest(
            inputs=PROMPT,
            parameters=pb.GenerateParameters(max_new_tokens=200, ignore_eos=True),
        )
        results: list[tuple[str, int | grpc.StatusCode]] = []
        lock = threading.Lock()
        streaming = [threading.Event() for _ in range(6)]

        def stream_one(index: int) -> None:
            try:
                messages = []
                for message in stub.GenerateStream(long_request, timeout=120):
                    messages.append(message)
                    streaming[index].set()
                finished = messages[-1].HasField("details")  # the last message of a stream
                outcome: tuple[str, int | grpc.StatusCode] = ("ok", int(finished))
            except grpc.RpcError as exc:
                outcome = ("error", exc.code())
            finally:
                streaming[index].set()  # a stream that failed first is reported below
            with lock:
                results.append(outcome)

        with channel:
            # Round robin over two replicas: 6 streams put 3 on each.
            threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            # Every stream has its first token, so it is admitted on its replica (a fixed
            # pause was not enough on a loaded machine: a stream that reached the first
            # replica after SIGTERM was refused, and "all six finish" failed).
            for event in streaming:
                assert event.wait(120), "a stream neither produced a token nor failed"
            first.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            # Raw calls: nginx knows nothing of the drain and keeps sending every other call to
            # the draining replica, which answers UNAVAILABLE (a status meshes retry on) ...
            # status_of also counts as UNAVAILABLE the CANCELLED that gRPC's server sends for a
            # call that reaches it in the instant it closes (grpc/grpc#41785), seen via nginx.
            later: list[grpc.StatusCode] = []
            for _ in range(10):
                try:
                    stub.Generate(
                        pb.GenerateRequest(inputs=["Hi"], parameters=_greedy(2)), timeout=60
                    )
                    later.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    later.append(status_of(exc)[0])
            # ... and a client that retries UNAVAILABLE (genserve's Python client does) is
            # always served by the other replica.
            with Client(proxy.address, timeout=60) as client:
                retried = [client.generate("Hi", max_new_tokens=2).generated_text for _ in range(6)]
            for t in threads:
                t.join(150)
            assert first.proc.wait(90) == 0  # drained and exited cleanly
        print("nginx error.log (shown when an assertion fails):\n" + proxy.error_log()[-4000:])
        oks = [n for kind, n in results if kind == "ok"]
        errors = [code for kind, code in results if kind == "error"]
        assert set(errors) <= {grpc.StatusCode.UNAVAILABLE}, results
        assert len(oks) == 6, f"streams in flight did not all finish: {results}"
        assert all(n == 1 for n in oks), results
        assert set(later) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, later
        assert later.count(grpc.StatusCode.OK) >= 5, later
        assert len(retried) == 6
        assert second.proc.poll() is None
        upstreams = {
            line.split("upstream=")[1].split()[0] for line in proxy.access_log().splitlines()[-10:]
        }
        assert second.address in " ".join(upstreams), upstreams
