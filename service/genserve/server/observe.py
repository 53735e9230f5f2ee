"""Per-sequence observability: what happened to each prompt between validation and its last
token, turned into metrics, child spans and one log line.

The servicer calls :meth:`RequestObserver.validate` around validation and wraps each
sequence's token stream in :meth:`RequestObserver.track`; the engine calls
:meth:`RequestObserver.on_step` after every step.  All three run on the event-loop thread, so
the records need no lock.  A step costs a dictionary lookup and a few integer updates per
scheduled request; spans are built once, when a sequence ends, from the recorded monotonic
timestamps (nothing per token is a span, a lock or I/O).

Span tree, under the RPC's server span (``server.interceptors``)::

    validate                       validation and tokenization
    sequence                       arrival at the engine → last token; request attributes
      ├─ queue                     arrival → first scheduled step
      ├─ prefill (one per chunk)   the step that computed the chunk
      └─ decode                    first decode step → last token, aggregated
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import grpc
import structlog
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer

from genserve.engine.async_engine import StepObservation
from genserve.engine.outputs import FinalInfo, GenerationRequest
from genserve.engine.request import FinishReason
from genserve.engine.streaming import EngineUnavailableError
from genserve.logging import bind_request_id
from genserve.metrics import STEP_KINDS, Metrics
from genserve.tracing import epoch_ns, retro_span

log = structlog.get_logger("genserve.requests")

SUCCESS_OUTCOMES = frozenset(
    r.value for r in (FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE)
)

# The gRPC context of the call being served, set by the interceptor, so that a sequence that
# ends without a result can tell a deadline from a client cancellation.
CALL_CONTEXT: contextvars.ContextVar[grpc.aio.ServicerContext | None] = contextvars.ContextVar(
    "genserve_call_context", default=None
)


def bind_call(req_id: str) -> None:
    """The call's request id goes on its log lines and, when traced, on its server span."""
    bind_request_id(req_id)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("genserve.req_id", req_id)


# A client whose deadline passes cancels the call itself, and the server may hear of it
# before its own copy of the deadline (set when it parsed the call's headers, a little later)
# expires; a call cancelled this close to its deadline counts as a deadline.
DEADLINE_SLACK_S = 0.5


def cancel_reason(call: grpc.aio.ServicerContext | None) -> str:
    """``deadline`` when the call's deadline has (about) passed, else ``cancelled``."""
    if call is not None:
        remaining = call.time_remaining()
        if remaining is not None and remaining <= DEADLINE_SLACK_S:
            return "deadline"
    return "cancelled"


@dataclass(frozen=True, slots=True)
class _Chunk:
    """A prefill chunk of one sequence and the step that computed it."""

    start_s: float
    end_s: float
    start_pos: int
    num_tokens: int
    batch_size: int
    step_tokens: int
    step_id: int


@dataclass(slots=True)
class SequenceRecord:
    """One sequence from arrival at the engine to its end.  Times are ``time.monotonic()``."""

    req_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    arrival_s: float
    call: grpc.aio.ServicerContext | None
    span: Span | None  # the RPC's server span, when traced
    keep_chunks: bool
    adapter_id: str | None = None  # the LoRA adapter the request named
    scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_tokens: int = 0
    first_decode_s: float | None = None
    num_decode_steps: int = 0
    decode_batch_sum: int = 0
    decode_batch_max: int = 0
    resumed_s: list[float] = field(default_factory=list)  # readmissions after preemption
    chunks: list[_Chunk] = field(default_factory=list)
    final: FinalInfo | None = None

    def finished(self, final: FinalInfo) -> None:
        """The engine's last message for this sequence (success or not)."""
        self.final = final


class _Tracked:
    """Context manager returned by :meth:`RequestObserver.track`."""

    __slots__ = ("_observer", "_record")

    def __init__(self, observer: RequestObserver, record: SequenceRecord) -> None:
        self._observer = observer
        self._record = record

    def __enter__(self) -> SequenceRecord:
        return self._record

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._observer._end(self._record, exc)


class RequestObserver:
    """Turns sequence lifecycles and engine steps into metrics, spans and log lines.

    ``metrics`` None: no metrics; ``tracer`` None: no spans; both None still logs one line
    per sequence.  ``log_requests`` adds prompts and generated text to the log lines."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        tracer: Tracer | None = None,
        *,
        log_requests: bool = False,
    ) -> None:
        self.metrics = metrics
        self.tracer = tracer
        self.log_requests = log_requests
        self._live: dict[str, SequenceRecord] = {}
        if metrics is not None:
            self._step_count = {k: metrics.step_count.labels(k) for k in STEP_KINDS}
            self._step_duration = {k: metrics.step_duration.labels(k) for k in STEP_KINDS}

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ servicer hooks
    def validate(
        self, req_id: str, text: str, run: Callable[[], GenerationRequest]
    ) -> GenerationRequest:
        """Run ``run`` (validation and tokenization) as the ``validate`` step of ``req_id``;
        exceptions propagate unchanged."""
        started = time.monotonic()
        span = None
        if self.tracer is not None:
            span = self.tracer.start_span("validate", attributes={"genserve.req_id": req_id})
        try:
            req = run()
        except Exception as exc:
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                span.record_exception(exc)
                span.end()
            raise
        elapsed = time.monotonic() - started
        num_prompt = len(req.prompt_token_ids)
        max_new = req.stopping.max_new_tokens
        if self.metrics is not None:
            self.metrics.validation_duration.observe(elapsed)
            self.metrics.input_length.observe(num_prompt)
            self.metrics.max_new_tokens.observe(max_new)
        if span is not None:
            span.set_attribute("gen_ai.usage.input_tokens", num_prompt)
            span.set_attribute("gen_ai.request.max_tokens", max_new)
            if req.adapter_id:
                span.set_attribute("genserve.adapter_id", req.adapter_id)
            span.end()
        if self.log_requests:
            log.info(
                "request_received",
                req_id=req_id,
                inputs=text,
                input_tokens=num_prompt,
                max_new_tokens=max_new,
            )
        return req

    def track(self, req: GenerationRequest) -> _Tracked:
        """``with observer.track(req) as record:`` around the sequence's stream from the
        engine; call ``record.finished(final)`` when the final output arrives.  Leaving the
        block records the outcome: the final's, or cancelled/deadline/error otherwise."""
        bind_request_id(req.req_id)
        current = trace.get_current_span() if self.tracer is not None else None
        record = SequenceRecord(
            req_id=req.req_id,
            num_prompt_tokens=len(req.prompt_token_ids),
            max_new_tokens=req.stopping.max_new_tokens,
            arrival_s=time.monotonic(),
            call=CALL_CONTEXT.get(),
            span=current if current is not None and current.is_recording() else None,
            keep_chunks=self.tracer is not None,
            adapter_id=req.adapter_id,
        )
        # A duplicate id is refused by the engine; keep following the first one.
        self._live.setdefault(req.req_id, record)
        return _Tracked(self, record)

    # ------------------------------------------------------------------ engine hook
    def on_step(self, obs: StepObservation) -> None:
        """Engine step observer: admissions, prefill chunks, decode steps, token times."""
        end = time.monotonic() if obs.ended_s is None else obs.ended_s
        start = end - obs.duration_s
        step = obs.step
        batch = len(step.chunks)
        admitted = {n.req_id for n in step.new_requests} if step.new_requests else ()
        metrics = self.metrics
        live = self._live
        num_prefill = 0
        step_tokens = -1  # computed on first need
        for chunk in step.chunks:
            rec = live.get(chunk.req_id)
            if rec is None:
                # Untracked (a test driving the engine directly): classify by shape only.
                num_prefill += not chunk.is_decode or chunk.req_id in admitted
                continue
            if chunk.req_id in admitted:
                if rec.scheduled_s is None:
                    rec.scheduled_s = start
                    if metrics is not None:
                        metrics.queue_duration.observe(start - rec.arrival_s)
                else:
                    rec.resumed_s.append(start)
            if chunk.start_pos < rec.num_prompt_tokens or not chunk.is_decode:
                num_prefill += 1
                if rec.keep_chunks:
                    if step_tokens < 0:
                        step_tokens = step.num_tokens
                    rec.chunks.append(
                        _Chunk(
                            start,
                            end,
                            chunk.start_pos,
                            len(chunk.token_ids),
                            batch,
                            step_tokens,
                            step.step_id,
                        )
                    )
            else:
                if rec.first_decode_s is None:
                    rec.first_decode_s = start
                rec.num_decode_steps += 1
                rec.decode_batch_sum += batch
                if batch > rec.decode_batch_max:
                    rec.decode_batch_max = batch
            if chunk.sample:
                # A speculative chunk can bring several tokens: each gets an equal share of
                # the time since the previous one.
                num_new = obs.num_spec_tokens.get(chunk.req_id, 1)
                if rec.last_token_s is None:
                    rec.first_token_s = end
                    if metrics is not None:
                        metrics.time_to_first_token.observe(end - rec.arrival_s)
                elif metrics is not None:
                    for _ in range(num_new):
                        metrics.inter_token.observe((end - rec.last_token_s) / num_new)
                rec.last_token_s = end
                rec.num_tokens += num_new
        if metrics is not None and batch:
            kind = "prefill" if num_prefill == batch else "decode" if not num_prefill else "mixed"
            self._step_count[kind].inc()
            self._step_duration[kind].observe(obs.duration_s)

    # ------------------------------------------------------------------ the end
    def _end(self, rec: SequenceRecord, exc: BaseException | None) -> None:
        ended = time.monotonic()
        if self._live.get(rec.req_id) is rec:
            del self._live[rec.req_id]
        final = rec.final
        outcome = _outcome(rec, exc)
        metrics = self.metrics
        if metrics is not None:
            if outcome in ("cancelled", "deadline"):
                metrics.cancellations.labels(outcome).inc()
            elif final is not None and outcome in SUCCESS_OUTCOMES:
                self._observe_success(metrics, rec, final)
        if rec.span is not None and self.tracer is not None:
            _emit_spans(self.tracer, rec, outcome, ended)
        self._log_end(rec, outcome, exc, ended)

    @staticmethod
    def _observe_success(metrics: Metrics, rec: SequenceRecord, final: FinalInfo) -> None:
        metrics.generated_tokens.observe(final.num_generated_tokens)
        if rec.scheduled_s is not None and rec.last_token_s is not None:
            inference = rec.last_token_s - rec.scheduled_s
            metrics.inference_duration.observe(inference)
            if final.num_generated_tokens:
                metrics.mean_time_per_token.observe(inference / final.num_generated_tokens)

    def _log_end(
        self, rec: SequenceRecord, outcome: str, exc: BaseException | None, ended: float
    ) -> None:
        final = rec.final
        fields: dict[str, Any] = {
            "req_id": rec.req_id,
            "outcome": outcome,
            "input_tokens": rec.num_prompt_tokens,
            "generated_tokens": final.num_generated_tokens if final else rec.num_tokens,
            "total_time_s": round(ended - rec.arrival_s, 6),
        }
        if final is not None:
            fields["cached_tokens"] = final.num_cached_tokens
            fields["preemptions"] = final.num_preemptions
        if rec.scheduled_s is not None:
            fields["queue_time_s"] = round(rec.scheduled_s - rec.arrival_s, 6)
        if rec.first_token_s is not None:
            fields["time_to_first_token_s"] = round(rec.first_token_s - rec.arrival_s, 6)
        if final is not None and final.error:
            fields["error"] = final.error
        elif exc is not None and outcome == "error":
            fields["error"] = f"{type(exc).__name__}: {exc}"
        if self.log_requests and final is not None:
            fields["generated_text"] = final.generated_text
        if outcome in SUCCESS_OUTCOMES:
            log.info("request_finished", **fields)
        elif outcome in ("cancelled", "deadline"):
            log.info("request_cancelled", **fields)
        else:
            log.warning("request_failed", **fields)


def _outcome(rec: SequenceRecord, exc: BaseException | None) -> str:
    """length | eos_token | stop_sequence | aborted | error | cancelled | deadline."""
    if rec.final is not None:
        return rec.final.finish_reason.value
    if exc is None or isinstance(exc, asyncio.CancelledError | GeneratorExit):
        # No result and no error: the consumer stopped listening (client gone, deadline).
        return cancel_reason(rec.call)
    if isinstance(exc, EngineUnavailableError):
        return FinishReason.ABORTED.value
    return FinishReason.ERROR.value


def _emit_spans(tracer: Tracer, rec: SequenceRecord, outcome: str, ended: float) -> None:
    assert rec.span is not None
    final = rec.final
    attributes: dict[str, Any] = {
        "genserve.req_id": rec.req_id,
        "gen_ai.usage.input_tokens": rec.num_prompt_tokens,
        "gen_ai.request.max_tokens": rec.max_new_tokens,
        "gen_ai.usage.output_tokens": final.num_generated_tokens if final else rec.num_tokens,
        "gen_ai.response.finish_reasons": (outcome,),
        "genserve.finish_reason": outcome,
    }
    if rec.adapter_id:
        attributes["genserve.adapter_id"] = rec.adapter_id
    if final is not None:
        attributes["genserve.cached_prompt_tokens"] = final.num_cached_tokens
        attributes["genserve.preemptions"] = final.num_preemptions
    sequence = tracer.start_span(
        "sequence",
        context=trace.set_span_in_context(rec.span),
        attributes=attributes,
        start_time=epoch_ns(rec.arrival_s),
    )
    for resumed in rec.resumed_s:
        sequence.add_event("resumed_after_preemption", timestamp=epoch_ns(resumed))
    if outcome in ("error", "aborted"):
        sequence.set_status(Status(StatusCode.ERROR, (final.error if final else None) or outcome))
    queue_end = rec.scheduled_s if rec.scheduled_s is not None else ended
    retro_span(tracer, "queue", sequence, rec.arrival_s, queue_end, {"genserve.req_id": rec.req_id})
    for chunk in rec.chunks:
        retro_span(
            tracer,
            "prefill",
            sequence,
            chunk.start_s,
            chunk.end_s,
            {
                "genserve.req_id": rec.req_id,
                "genserve.prefill.start_pos": chunk.start_pos,
                "genserve.prefill.num_tokens": chunk.num_tokens,
                "genserve.batch_size": chunk.batch_size,
                "genserve.step.num_tokens": chunk.step_tokens,
                "genserve.step.id": chunk.step_id,
            },
        )
    if rec.first_decode_s is not None and rec.last_token_s is not None:
        retro_span(
            tracer,
            "decode",
            sequence,
            rec.first_decode_s,
            rec.last_token_s,
            {
                "genserve.req_id": rec.req_id,
                "genserve.decode.num_steps": rec.num_decode_steps,
                "genserve.batch_size": rec.decode_batch_sum / rec.num_decode_steps,
                "genserve.batch_size.max": rec.decode_batch_max,
                "gen_ai.usage.output_tokens": attributes["gen_ai.usage.output_tokens"],
            },
        )
    sequence.end(end_time=epoch_ns(ended))
