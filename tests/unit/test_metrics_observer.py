"""genserve.server.observe: sequences driven through a real scheduler (and the paged fake
runner the scheduler tests use) exactly as the engine drives them; the observer must turn
the steps into the right metric counts and the right span tree."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, Tracer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scheduler_fakes import Harness  # type: ignore[import-not-found]  # pytest puts tests/unit on sys.path

from genserve.engine.async_engine import StepObservation
from genserve.engine.outputs import FinalInfo, GenerationRequest
from genserve.engine.request import StoppingCriteria
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.metrics import Metrics
from genserve.server.observe import RequestObserver, SequenceRecord, _Tracked
from genserve.step import SamplingParams


@dataclass
class Tracing:
    tracer: Tracer
    exporter: InMemorySpanExporter


@pytest.fixture
def tracing() -> Iterator[Tracing]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Tracing(provider.get_tracer("test"), exporter)
    provider.shutdown()


def value(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    text = generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == (labels or {}):
                return float(s.value)
    raise KeyError(name)


class Engine:
    """Drives Harness steps and the observer the way AsyncEngine + servicer do."""

    def __init__(self, observer: RequestObserver, config: SchedulerConfig) -> None:
        self.observer = observer
        self.harness = Harness(config)
        self.tracked: dict[str, tuple[_Tracked, SequenceRecord]] = {}
        self.prompts: dict[str, list[int]] = {}

    def submit(self, req_id: str, prompt: list[int], max_new_tokens: int) -> None:
        stopping = StoppingCriteria(max_new_tokens=max_new_tokens)
        req = self.observer.validate(
            req_id,
            "some text",
            lambda: GenerationRequest(req_id, tuple(prompt), SamplingParams(), stopping),
        )
        tracked = self.observer.track(req)
        self.tracked[req_id] = (tracked, tracked.__enter__())
        self.prompts[req_id] = prompt
        self.harness.add(req_id, prompt, max_new_tokens)

    def step(self) -> None:
        started = time.perf_counter()
        step = self.harness.step()
        self.observer.on_step(StepObservation(step, time.perf_counter() - started, 0))
        for req_id, reason in list(self.harness.ends.items()):
            if req_id in self.tracked:
                tracked, record = self.tracked.pop(req_id)
                req = self.harness.reqs[req_id]
                record.finished(
                    FinalInfo(
                        finish_reason=reason,
                        generated_text="",
                        num_generated_tokens=len(self.harness.tokens[req_id]),
                        num_prompt_tokens=len(self.prompts[req_id]),
                        num_cached_tokens=req.num_cached_tokens,
                        num_preemptions=req.num_preemptions,
                    )
                )
                tracked.__exit__(None, None, None)

    def cancel(self, req_id: str, deadline: bool = False) -> None:
        tracked, _ = self.tracked.pop(req_id)
        self.harness.abort(req_id)
        tracked.__exit__(asyncio.CancelledError, asyncio.CancelledError(), None)

    def run(self) -> None:
        while self.harness.sched.has_unfinished_requests():
            self.step()


def children(spans: list[ReadableSpan], parent: ReadableSpan | Span) -> list[ReadableSpan]:
    parent_id = parent.get_span_context().span_id
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent_id]


def test_metrics_from_real_steps() -> None:
    metrics = Metrics()
    engine = Engine(
        RequestObserver(metrics),
        SchedulerConfig(num_blocks=64, block_size=4, max_batch_prefill_tokens=8),
    )
    lengths = {"b": (3, 4), "a": (20, 5), "c": (9, 1)}
    for req_id, (num_prompt, max_new) in lengths.items():
        engine.submit(req_id, list(range(100, 100 + num_prompt)), max_new)
    engine.run()
    total_tokens = sum(max_new for _, max_new in lengths.values())
    assert value(metrics, "genserve_request_validation_duration_count") == 3
    assert value(metrics, "genserve_request_input_length_sum") == 32
    assert value(metrics, "genserve_request_max_new_tokens_sum") == total_tokens
    assert value(metrics, "genserve_request_queue_duration_count") == 3
    assert value(metrics, "genserve_request_time_to_first_token_duration_count") == 3
    assert value(metrics, "genserve_request_inter_token_duration_count") == total_tokens - 3
    assert value(metrics, "genserve_request_generated_tokens_sum") == total_tokens
    assert value(metrics, "genserve_request_inference_duration_count") == 3
    assert value(metrics, "genserve_request_mean_time_per_token_duration_count") == 3
    steps = [s for s in engine.harness.steps if s.chunks]
    counted = sum(
        value(metrics, "genserve_batch_inference_count_total", {"method": m})
        for m in ("prefill", "decode", "mixed")
    )
    assert counted == len(steps)
    # "b" decodes while "a" is still prefilled in chunks of <= 8 tokens: mixed steps.
    assert value(metrics, "genserve_batch_inference_count_total", {"method": "mixed"}) >= 1
    assert engine.observer.num_live == 0


def test_cancellations_are_counted_and_leave_no_record() -> None:
    metrics = Metrics()
    engine = Engine(RequestObserver(metrics), SchedulerConfig(num_blocks=64, block_size=4))
    engine.submit("a", list(range(10)), 50)
    engine.submit("b", list(range(5)), 3)
    engine.step()
    engine.cancel("a")
    engine.run()
    assert value(metrics, "genserve_request_cancellations_total", {"reason": "cancelled"}) == 1
    assert value(metrics, "genserve_request_cancellations_total", {"reason": "deadline"}) == 0
    # Only the finished sequence counts as generated.
    assert value(metrics, "genserve_request_generated_tokens_count") == 1
    assert engine.observer.num_live == 0


def test_span_tree_and_attributes(tracing: Tracing) -> None:
    observer = RequestObserver(tracer=tracing.tracer)
    engine = Engine(
        observer, SchedulerConfig(num_blocks=64, block_size=4, max_batch_prefill_tokens=8)
    )
    prompt = list(range(100, 120))  # 20 tokens: chunks of 8, 8, 4
    with tracing.tracer.start_as_current_span("rpc-a") as rpc_a:
        engine.submit("a", prompt, 5)
    engine.run()
    with tracing.tracer.start_as_current_span("rpc-b") as rpc_b:
        engine.submit("b", prompt, 3)  # same prompt: 16 tokens (4 full blocks) cached
    engine.run()
    spans = list(tracing.exporter.get_finished_spans())

    (sequence_a, validate_a) = sorted(children(spans, rpc_a), key=lambda s: s.name)
    assert validate_a.name == "validate"
    assert validate_a.attributes["gen_ai.usage.input_tokens"] == 20
    assert sequence_a.name == "sequence"
    attrs = sequence_a.attributes
    assert attrs["genserve.req_id"] == "a"
    assert attrs["gen_ai.usage.input_tokens"] == 20
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["genserve.finish_reason"] == "length"
    assert attrs["genserve.cached_prompt_tokens"] == 0
    assert attrs["genserve.preemptions"] == 0
    inner = children(spans, sequence_a)
    assert sorted(s.name for s in inner) == ["decode", "prefill", "prefill", "prefill", "queue"]
    prefills = sorted((s for s in inner if s.name == "prefill"), key=lambda s: s.start_time)
    assert [p.attributes["genserve.prefill.start_pos"] for p in prefills] == [0, 8, 16]
    assert [p.attributes["genserve.prefill.num_tokens"] for p in prefills] == [8, 8, 4]
    assert all(p.attributes["genserve.batch_size"] == 1 for p in prefills)
    (decode,) = (s for s in inner if s.name == "decode")
    assert decode.attributes["genserve.decode.num_steps"] == 4  # first token came from prefill
    (queue,) = (s for s in inner if s.name == "queue")
    # Child spans sit inside their parent, in order.
    assert sequence_a.start_time <= queue.start_time <= queue.end_time <= prefills[0].start_time
    assert prefills[-1].end_time <= decode.start_time <= decode.end_time <= sequence_a.end_time

    (sequence_b,) = (s for s in children(spans, rpc_b) if s.name == "sequence")
    assert sequence_b.attributes["genserve.cached_prompt_tokens"] == 16
    (prefill_b,) = (s for s in children(spans, sequence_b) if s.name == "prefill")
    assert prefill_b.attributes["genserve.prefill.start_pos"] == 16
    # Every span of a sequence belongs to its call's trace.
    for rpc, req_id in ((rpc_a, "a"), (rpc_b, "b")):
        mine = [s for s in spans if s.attributes.get("genserve.req_id") == req_id]
        assert len(mine) >= 4
        assert {s.context.trace_id for s in mine} == {rpc.get_span_context().trace_id}


def test_preemption_shows_as_attribute_and_event(tracing: Tracing) -> None:
    observer = RequestObserver(Metrics(), tracing.tracer)
    # 6 blocks of 4 tokens: two requests growing to 8 + 12 tokens each cannot both stay.
    engine = Engine(observer, SchedulerConfig(num_blocks=6, block_size=4, growth_reserve_ratio=0.0))
    with tracing.tracer.start_as_current_span("rpc"):
        engine.submit("old", list(range(1, 9)), 12)
        engine.submit("new", list(range(21, 29)), 12)
    engine.run()
    assert engine.harness.sched.stats().num_preemptions >= 1
    spans = tracing.exporter.get_finished_spans()
    sequences = {s.attributes["genserve.req_id"]: s for s in spans if s.name == "sequence"}
    preempted = engine.harness.reqs["new"].num_preemptions
    assert preempted >= 1
    assert sequences["new"].attributes["genserve.preemptions"] == preempted
    events = [e.name for e in sequences["new"].events]
    assert events == ["resumed_after_preemption"] * preempted
    assert sequences["new"].attributes["gen_ai.usage.output_tokens"] == 12


def test_validation_failure_marks_the_span(tracing: Tracing) -> None:
    metrics = Metrics()
    observer = RequestObserver(metrics, tracing.tracer)

    def bad() -> GenerationRequest:
        raise ValueError("`top_p` must be in (0, 1], got 2")

    with tracing.tracer.start_as_current_span("rpc"), pytest.raises(ValueError):
        observer.validate("x", "text", bad)
    (span,) = (s for s in tracing.exporter.get_finished_spans() if s.name == "validate")
    assert not span.status.is_ok
    assert "top_p" in (span.status.description or "")
    assert value(metrics, "genserve_request_validation_duration_count") == 0


def test_untraced_observer_builds_no_spans() -> None:
    """No tracer: records keep no chunk list and nothing tries to build spans."""
    engine = Engine(RequestObserver(), SchedulerConfig(num_blocks=64, block_size=4))
    engine.submit("a", list(range(30)), 3)
    record = engine.tracked["a"][1]
    engine.step()
    assert record.span is None and not record.keep_chunks and record.chunks == []
    engine.run()
