"""Observability end to end, on a real ``genserve`` process: the spans a real OTLP/gRPC
receiver process gets for a request that carries a known ``traceparent``; deltas of the real
``/metrics`` endpoint around known requests; JSON log lines with request and trace ids."""

from __future__ import annotations

import json
import secrets
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.live_server import LiveServer, free_port, start_server
from tests.utils.otlp_receiver import OtlpReceiver, ReceivedSpan

SERVICE = "genserve.v1.TextGenerationService"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER
# 25 tokens: one full block of 16 is reused by the second identical request.
PROMPT = (
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat "
    "near the door of the old house"
)
# With the tiny seed-1 model, greedy decoding of this prompt does not meet EOS for hundreds
# of tokens: long enough to be cancelled or to outlive a deadline.
LONG_PROMPT = "Hello world, how are you?"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Observed:
    server: LiveServer
    receiver: OtlpReceiver
    metrics_port: int
    stub: pb_grpc.TextGenerationServiceStub

    def scrape(self) -> Samples:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        out: Samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def log_lines(self, needle: str) -> list[dict[str, Any]]:
        """JSON log lines mentioning ``needle`` (the log also holds non-JSON library output)."""
        lines = []
        for line in self.server.logs().splitlines():
            if needle in line and line.startswith("{"):
                lines.append(json.loads(line))
        return lines


@pytest.fixture(scope="module")
def observed(tiny_llama: Path) -> Iterator[Observed]:
    receiver = OtlpReceiver()
    metrics_port = free_port()
    try:
        with (
            start_server(
                tiny_llama,
                "--prometheus-port",
                str(metrics_port),
                "--otlp-endpoint",
                receiver.endpoint,
                "--otlp-service-name",
                "genserve-e2e",
                "--json-output",
                "--max-batch-total-tokens",
                "32768",
                env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # export spans every 100 ms
            ) as server,
            grpc.insecure_channel(server.address) as channel,
        ):
            yield Observed(
                server, receiver, metrics_port, pb_grpc.TextGenerationServiceStub(channel)
            )
    finally:
        receiver.stop()


def _traceparent() -> tuple[str, str, tuple[tuple[str, str], ...]]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent_id, (("traceparent", f"00-{trace_id}-{parent_id}-01"),)


def _spans_of(receiver: OtlpReceiver, trace_id: str, num_sequences: int) -> list[ReceivedSpan]:
    def ready(spans: list[ReceivedSpan]) -> bool:
        mine = [s for s in spans if s.trace_id == trace_id]
        return sum(s.name == "sequence" for s in mine) >= num_sequences and any(
            s.kind == SERVER_KIND for s in mine
        )

    return [s for s in receiver.wait_for(ready) if s.trace_id == trace_id]


def _one(spans: list[ReceivedSpan], pred: Callable[[ReceivedSpan], bool]) -> ReceivedSpan:
    (span,) = (s for s in spans if pred(s))
    return span


def test_stream_trace_continues_the_callers_trace(observed: Observed) -> None:
    trace_id, parent_id, metadata = _traceparent()
    params = pb.GenerateParameters(max_new_tokens=8)
    messages = list(
        observed.stub.GenerateStream(
            pb.GenerateStreamRequest(inputs=PROMPT, parameters=params),
            metadata=(*metadata, ("x-request-id", "obs-stream")),
        )
    )
    details = messages[-1].details
    assert details.generated_tokens == 8
    spans = _spans_of(observed.receiver, trace_id, 1)

    server = _one(spans, lambda s: s.kind == SERVER_KIND)
    assert server.name == f"{SERVICE}/GenerateStream"
    assert server.parent_span_id == parent_id  # the caller's span
    assert server.attributes["rpc.grpc.status_code"] == 0
    assert server.attributes["rpc.method"] == "GenerateStream"
    assert server.attributes["genserve.req_id"] == "obs-stream"
    assert server.resource["service.name"] == "genserve-e2e"

    validate = _one(spans, lambda s: s.name == "validate")
    assert validate.parent_span_id == server.span_id
    assert validate.attributes["gen_ai.usage.input_tokens"] == details.input_length

    sequence = _one(spans, lambda s: s.name == "sequence")
    assert sequence.parent_span_id == server.span_id
    attrs = sequence.attributes
    assert attrs["genserve.req_id"] == "obs-stream"
    assert attrs["gen_ai.usage.input_tokens"] == details.input_length
    assert attrs["gen_ai.usage.output_tokens"] == 8
    assert attrs["genserve.finish_reason"] == "length"
    assert attrs["genserve.cached_prompt_tokens"] == details.cached_tokens
    assert attrs["genserve.preemptions"] == 0

    inner = [s for s in spans if s.parent_span_id == sequence.span_id]
    queue = _one(inner, lambda s: s.name == "queue")
    prefills = sorted((s for s in inner if s.name == "prefill"), key=lambda s: s.start_ns)
    decode = _one(inner, lambda s: s.name == "decode")
    computed = details.input_length - details.cached_tokens
    assert sum(p.attributes["genserve.prefill.num_tokens"] for p in prefills) == computed
    assert prefills[0].attributes["genserve.prefill.start_pos"] == details.cached_tokens
    assert all(p.attributes["genserve.batch_size"] >= 1 for p in prefills)
    assert decode.attributes["genserve.decode.num_steps"] == 7  # the 1st token ends prefill
    assert decode.attributes["gen_ai.usage.output_tokens"] == 8
    # Time flows downwards and children sit inside their parents.
    assert server.start_ns <= validate.start_ns <= validate.end_ns <= sequence.start_ns
    assert sequence.start_ns <= queue.start_ns <= queue.end_ns <= prefills[0].start_ns
    assert prefills[-1].end_ns <= decode.start_ns <= decode.end_ns <= sequence.end_ns
    assert sequence.end_ns <= server.end_ns

    # Log lines of this request carry its id and the trace's ids (and no prompt).
    lines = observed.log_lines('"obs-stream"')
    finished = [line for line in lines if line["event"] == "request_finished"]
    assert len(finished) == 1 and finished[0]["generated_tokens"] == 8
    assert all(line["req_id"] == "obs-stream" and line["trace_id"] == trace_id for line in lines)
    assert PROMPT not in observed.server.logs()


def test_multi_input_generate_has_a_sequence_span_per_input(observed: Observed) -> None:
    trace_id, parent_id, metadata = _traceparent()
    observed.stub.Generate(
        pb.GenerateRequest(
            inputs=["first prompt", "a second, longer prompt"],
            parameters=pb.GenerateParameters(max_new_tokens=3),
        ),
        metadata=(*metadata, ("x-request-id", "obs-multi")),
    )
    spans = _spans_of(observed.receiver, trace_id, 2)
    server = _one(spans, lambda s: s.kind == SERVER_KIND)
    assert server.name == f"{SERVICE}/Generate" and server.parent_span_id == parent_id
    sequences = [s for s in spans if s.name == "sequence"]
    assert sorted(s.attributes["genserve.req_id"] for s in sequences) == [
        "obs-multi-0",
        "obs-multi-1",
    ]
    assert all(s.parent_span_id == server.span_id for s in sequences)
    assert sum(s.name == "validate" for s in spans) == 2


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_deltas_match_known_requests(observed: Observed) -> None:
    stub = observed.stub
    before = observed.scrape()
    results = []
    for _ in range(2):  # the second finds the first's full block in the prefix cache
        response = stub.Generate(
            pb.GenerateRequest(
                inputs=[PROMPT], parameters=pb.GenerateParameters(max_new_tokens=6, details=True)
            )
        )
        results.append(response.results[0].details)
    stream = list(
        stub.GenerateStream(
            pb.GenerateStreamRequest(
                inputs="Tell me a story", parameters=pb.GenerateParameters(max_new_tokens=5)
            )
        )
    )
    results.append(stream[-1].details)
    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(pb.GenerateRequest(inputs=["x"], parameters=pb.GenerateParameters(top_p=2)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # context.abort() sends the status before the server's bookkeeping runs: wait for it.
    after = _until(
        observed,
        lambda s: _delta(before, s, "genserve_request_failure_total", err="validation") >= 1,
    )

    def delta(name: str, **labels: str) -> float:
        return _delta(before, after, name, **labels)

    generated = [d.generated_tokens for d in results]
    assert delta("genserve_request_count_total") == 4
    assert delta("genserve_request_success_total") == 3
    assert delta("genserve_request_failure_total", err="validation") == 1
    assert delta("genserve_request_failure_total", err="internal") == 0
    assert delta("genserve_request_duration_count") == 3
    assert delta("genserve_request_validation_duration_count") == 3
    assert delta("genserve_request_input_length_count") == 3
    assert delta("genserve_request_input_length_sum") == sum(d.input_length for d in results)
    assert delta("genserve_request_max_new_tokens_sum") == 6 + 6 + 5
    assert delta("genserve_request_generated_tokens_count") == 3
    assert delta("genserve_request_generated_tokens_sum") == sum(generated)
    assert delta("genserve_request_queue_duration_count") == 3
    assert delta("genserve_request_inference_duration_count") == 3
    assert delta("genserve_request_mean_time_per_token_duration_count") == 3
    assert delta("genserve_request_time_to_first_token_duration_count") == 3
    assert delta("genserve_request_inter_token_duration_count") == sum(generated) - 3
    steps = sum(
        delta("genserve_batch_inference_count_total", method=m)
        for m in ("prefill", "decode", "mixed")
    )
    assert steps >= max(generated)  # sequential calls: at least one step per token
    # The prefix cache: the second call (at least) reused what the first computed.
    assert results[1].cached_tokens > 0
    assert delta("genserve_prefix_cache_hits_total") == sum(d.cached_tokens for d in results)
    assert delta("genserve_prefix_cache_queries_total") >= sum(d.input_length for d in results)
    # Idle again: nothing running or waiting, every KV block back in the pool.
    info_response = stub.Info(pb.InfoRequest())
    assert after[("genserve_batch_current_size", ())] == 0
    assert after[("genserve_queue_size", ())] == 0
    assert after[("genserve_kv_cache_blocks_used", ())] == 0
    assert after[("genserve_kv_cache_blocks_total", ())] == info_response.num_kv_blocks
    (info_key,) = (k for k in after if k[0] == "genserve_info")
    assert dict(info_key[1])["model_id"] == info_response.model_id


def _until(
    observed: Observed, check: Callable[[Samples], bool], timeout_s: float = 15.0
) -> Samples:
    deadline = time.monotonic() + timeout_s
    while True:
        samples = observed.scrape()
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


def _report(before: Samples, after: Samples) -> str:
    """What changed in the failure and cancellation counters, and the KV blocks in use."""
    changed = {
        f"{name}{dict(labels)}": after[(name, labels)] - before.get((name, labels), 0.0)
        for name, labels in after
        if name in ("genserve_request_failure_total", "genserve_request_cancellations_total")
    }
    return f"deltas {changed}; blocks used {after[('genserve_kv_cache_blocks_used', ())]}"


def test_cancellation_and_deadline_are_counted(observed: Observed) -> None:
    stub = observed.stub
    before = observed.scrape()
    params = pb.GenerateParameters(max_new_tokens=2000, ignore_eos=True)
    stream = stub.GenerateStream(
        pb.GenerateStreamRequest(inputs=LONG_PROMPT, parameters=params),
        metadata=(("x-request-id", "obs-cancel"),),
    )
    for _ in range(3):
        next(stream)
    stream.cancel()

    def cancelled(s: Samples) -> bool:
        return (
            _delta(before, s, "genserve_request_failure_total", err="cancelled") == 1
            and _delta(before, s, "genserve_request_cancellations_total", reason="cancelled") == 1
            and s[("genserve_kv_cache_blocks_used", ())] == 0
        )

    after = _until(observed, cancelled)
    assert cancelled(after), _report(before, after)

    with pytest.raises(grpc.RpcError) as info:
        stub.Generate(
            pb.GenerateRequest(inputs=[LONG_PROMPT], parameters=params),
            # Long enough to reach the engine on a busy machine, short enough that the tiny
            # model cannot finish its ~1000 tokens first: at 2 s it did, once its decode
            # steps got faster (one fresh-clone run, ~1.3 ms a step).
            timeout=0.75,
            metadata=(("x-request-id", "obs-deadline"),),
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def expired(s: Samples) -> bool:
        return (
            _delta(before, s, "genserve_request_failure_total", err="deadline") == 1
            and _delta(before, s, "genserve_request_cancellations_total", reason="deadline") == 1
            and s[("genserve_kv_cache_blocks_used", ())] == 0
        )

    after = _until(observed, expired)
    assert expired(after), _report(before, after)
    assert _delta(before, after, "genserve_request_success_total") == 0
    (line,) = (x for x in observed.log_lines('"obs-deadline"') if x["event"] == "request_cancelled")
    assert line["outcome"] == "deadline"


def test_info_and_the_log_say_what_the_kv_cache_took(observed: Observed) -> None:
    info = observed.stub.Info(pb.InfoRequest())
    # --max-batch-total-tokens set it here; without, "limits" or "memory" (test_config.py).
    assert info.kv_cache_sized_by == "--max-batch-total-tokens"
    assert info.num_kv_blocks * info.block_size >= 32768
    (line,) = [e for e in observed.log_lines("kv_cache_sized") if e["event"] == "kv_cache_sized"]
    assert line["bytes"] == info.kv_cache_bytes > 0
    assert line["num_blocks"] == info.num_kv_blocks
    assert line["sized_by"] == info.kv_cache_sized_by
    assert line["bytes"] == line["bytes_per_block"] * info.num_kv_blocks
