"""The engine loop: schedule → run → apply tokens → stop checks → detokenise → hand outputs.

Everything here runs on the engine thread (:class:`~genserve.engine.engine_thread.
EngineThread`), on that thread's own asyncio loop, except ``Runner.execute_model``, which
runs in one more thread (the *step thread*) so that the next step can be prepared while a
step computes — except without ``overlap`` on a runner that says ``steps_inline`` (the CPU),
whose steps run on the engine thread itself: there the step thread overlapped nothing and
cost two thread wake-ups a step.  The scheduler, the per-request detokenisers and the stream
bookkeeping are owned by the engine thread and need no locks; requests and aborts arrive
through the engine thread's inbox (:meth:`EngineLoop.add`, :meth:`EngineLoop.abort`, posted
by the facade, ``engine/async_engine.py``).  Each step's outputs leave in **one** batch
(:class:`Delivery`) through the ``deliver`` callback, which the facade turns into one
``call_soon_threadsafe`` to the gRPC event loop; that loop puts the outputs into the request
streams and tells the step observers (metrics, traces).  The engine loop never waits for the
gRPC loop.

Where detokenisation runs, and why: here, on the engine thread, because a stop string ends
a request in the scheduler (freeing its KV blocks, keeping it out of the next batch) and
must be exact: the text up to the stop string, no token more, whatever the gRPC side's
timing.  (vLLM detokenises in its front end and aborts the request in the engine core when
a stop string shows up, a step or more late; SGLang checks stop strings in its scheduler,
as here.)  It does not delay the next step's queueing where the loop overlaps: with
``overlap`` the next step is queued to the step thread *before* step n is detokenised and
streamed (scheduled ahead, or right after step n's tokens are applied); without it the loop
is serial by design (every step streamed before the next is scheduled) — on the CPU, where
the "device" is the same cores, overlapping the host's work measured no gain
(docs/overlap-scheduling.md, "Default on the CPU").

With ``overlap`` (see docs/overlap-scheduling.md) step n + 1 is scheduled and handed to the
step thread *before* step n's tokens are known, whenever the scheduler allows it
(:meth:`Scheduler.can_schedule_ahead`) and the runner fills placeholder tokens
(``supports_token_from_last_step``).  A runner that splits a step into ``launch`` and
``collect`` (:class:`SplitRunner`) gets, in the step thread, launch n + 1 *before* collect
n: the device is handed step n + 1 before the host waits for step n's readback.  Outputs
are the same with and without ``overlap``.

Departure from DESIGN.md ("How a request flows": the engine loop, one task, on the
servicer's event loop): it is still one task, but on an event loop of its own in a
dedicated thread, so a busy gRPC loop (many streams serialised, a slow consumer) no longer
delays the hand-off of the next step to the runner.  The two threads share the GIL, so
what they still share is Python time, not turns of one loop.  The scheduler is read from
outside only through the engine thread (``AsyncEngine.call_in_engine``; the metrics'
scrape binds to its loop), and step observers run on the gRPC loop, not here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import structlog

from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason, Request
from genserve.engine.scheduler import EngineCoreOutput, Scheduler
from genserve.engine.token_info import prefill_infos, token_info, top_infos
from genserve.step import PromptLogprobs, Runner, RunnerOutput, SchedulerOutput, TokenLogprob
from genserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = structlog.get_logger(__name__)

# How long the loop sleeps when requests wait but none can be scheduled (blocks held by a
# step in flight are released by the next update); short, so arrivals are not delayed.
_IDLE_POLL_S = 0.005


@dataclass(frozen=True, slots=True)
class StepObservation:
    """What one engine step did, for metrics and traces."""

    step: SchedulerOutput
    duration_s: float
    num_finished: int
    # Tokens each request of a speculative chunk received (one per other sampling chunk).
    num_spec_tokens: Mapping[str, int] = field(default_factory=dict)
    # time.monotonic() when the step's result reached the engine thread: observers run later,
    # on the gRPC loop, so their own clock would stretch the step into the next one's span.
    ended_s: float | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    """One hand-off to the gRPC loop: outputs in order, and the step that made them (None
    for outputs not made by a step: failures, shutdown)."""

    outputs: list[tuple[str, TokenOutput]]
    observation: StepObservation | None = None


@dataclass(slots=True)
class _Stream:
    """Per-request output state, owned by the engine thread."""

    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    texts: list[str] = field(default_factory=list)
    num_generated: int = 0
    prompt_logprobs: dict[int, float] = field(default_factory=dict)
    prompt_top: dict[int, tuple[TokenLogprob, ...]] = field(default_factory=dict)  # #27


class SplitRunner(Protocol):
    """A runner that can queue a step and wait for it apart (``ModelRunner.launch`` /
    ``collect``): the step thread then launches step n + 1 before it collects step n."""

    def launch(self, step: SchedulerOutput) -> Any: ...

    def collect(self, launched: Any) -> RunnerOutput: ...


@dataclass(slots=True)
class _Running:
    """A step handed to the step thread, its result still to come: ``future`` (its
    ``execute_model``, or its collect once asked for), ``launched`` (a split runner's
    launch, whose collect is queued only when the loop awaits the result)."""

    step: SchedulerOutput
    future: asyncio.Future[RunnerOutput] | None
    started: float
    launched: concurrent.futures.Future[Any] | None = None


@dataclass(frozen=True, slots=True)
class _Finished:
    """A step the scheduler has updated, waiting to be streamed."""

    step: SchedulerOutput
    result: RunnerOutput
    outputs: list[EngineCoreOutput]
    duration_s: float
    ended_s: float  # time.monotonic() when the result arrived


class EngineLoop:
    """Drives a :class:`Scheduler` and a :class:`Runner` on the engine thread.

    Every method but the constructor and :attr:`num_steps` / :attr:`dead_reason` (plain
    reads) runs on the engine thread."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        tokenizer: Tokenizer,
        deliver: Callable[[Delivery], None],
        overlap: bool = False,
    ) -> None:
        self.overlap = overlap
        # Scheduling ahead needs a runner that fills placeholder tokens from its last step.
        self.schedule_ahead = overlap and bool(
            getattr(runner, "supports_token_from_last_step", False)
        )
        # Launch step n + 1 before collecting step n (in the step thread's order) where the
        # runner splits the two and steps are scheduled ahead.
        self._split: SplitRunner | None = None
        if self.schedule_ahead and callable(getattr(runner, "launch", None)):
            self._split = cast(SplitRunner, runner)
        # Without overlap, a runner whose steps compute synchronously on the host's own
        # cores (the CPU) runs them here, on the engine thread: a step thread would add two
        # thread wake-ups per step and overlap nothing (docs/benchmarks/cpu.md).
        self.inline = not overlap and bool(getattr(runner, "steps_inline", False))
        self.scheduler = scheduler
        self.runner = runner
        self._tokenizer = tokenizer
        self._deliver = deliver
        self._streams: dict[str, _Stream] = {}
        self._outbox: list[tuple[str, TokenOutput]] = []
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genserve-step")
        self._wake: asyncio.Event | None = None
        self.dead_reason: str | None = None
        self.num_steps = 0  # steps whose results were applied (read from any thread)

    # ----------------------------------------------------------------- inbox
    def add(self, req: GenerationRequest, request: Request, detok: IncrementalDetokenizer) -> None:
        """A new request (validated by the facade)."""
        self._streams[req.req_id] = _Stream(request=req, detokenizer=detok)
        if self.dead_reason is not None:  # raced with the engine's death
            self._end_stream(req.req_id, FinishReason.ERROR, error=self.dead_reason)
            self._flush()
            return
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:  # an id still in use: its abort is behind in the inbox
            self._end_stream(req.req_id, FinishReason.ERROR, error=str(exc))
            self._flush()

    def abort(self, req_id: str) -> None:
        """The client is gone (cancellation, deadline): end the request, no output."""
        stream = self._streams.pop(req_id, None)
        if stream is None:  # finished meanwhile
            return
        self.scheduler.finish_requests([req_id], FinishReason.ABORTED)
        log.info("request_aborted", req_id=req_id, generated_tokens=stream.num_generated)

    def wake(self) -> None:
        """Inbox drained: let an idle loop look at the new requests."""
        if self._wake is not None:
            self._wake.set()

    def die(self, reason: str) -> None:
        """A part the engine depends on is gone: fail every request, stop stepping."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        log.error("engine_dead", reason=reason)
        self.fail_all(FinishReason.ERROR, reason)
        self.wake()

    def fail_all(self, reason: FinishReason, message: str) -> None:
        """End every request now with ``reason`` (shutdown, death)."""
        ids = list(self._streams)
        self.scheduler.finish_requests(ids, reason)
        for req_id in ids:
            self._end_stream(req_id, reason, error=message)
        self._flush()

    # ----------------------------------------------------------------- the loop
    async def run(self) -> None:
        """schedule → run (in the step thread) → apply the result → stream.

        With ``overlap``: while step n runs, step n + 1 is scheduled ahead of it when the
        scheduler allows (its decode tokens are placeholders the runner fills from step n's
        sampled ids on the device) and queued in the step thread, so the runner never
        waits for the host.  Step n's result is applied when it arrives (stop conditions one
        step late: a request that ended then has its token from step n + 1 dropped) and
        streamed while step n + 1 runs.  Where scheduling ahead is not allowed, step n + 1
        is scheduled after step n's result is applied, then step n is streamed while it
        runs.  Without ``overlap`` every step is streamed before the next is scheduled."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        running: _Running | None = None
        while self.dead_reason is None:
            if running is None:
                running = await self._next_step(loop)
                if running is None:
                    continue
            ahead: _Running | None = None
            if self.schedule_ahead and self.scheduler.can_schedule_ahead(running.step):
                ahead = self._submit(loop, self.scheduler.schedule())
            try:
                result = await self._result(loop, running)
                outputs = self.scheduler.update_from_output(running.step, result)
            except Exception as exc:  # the runner failed: fail this step's requests
                self._on_step_failure(running.step, exc)
                running = ahead
                continue
            self.num_steps += 1
            done = _Finished(
                running.step, result, outputs, time.perf_counter() - running.started,
                time.monotonic(),
            )  # fmt: skip
            if self.overlap and ahead is None and self.scheduler.has_unfinished_requests():
                ahead = self._submit(loop, self.scheduler.schedule())
            self._emit_step(done)  # the host's work, while the step ahead runs
            running = ahead

    async def _next_step(self, loop: asyncio.AbstractEventLoop) -> _Running | None:
        """Schedule and submit a step with nothing in flight; None after waiting (no
        request, or nothing runnable now)."""
        assert self._wake is not None
        if self.inline:  # the last step ran on this thread: let arrivals and aborts in first
            await asyncio.sleep(0)
            # A die() let in by that yield has set and spent its wake-up: waiting for
            # another would hang the loop (run() checks dead_reason on return).
            if self.dead_reason is not None:
                return None
        if not self.scheduler.has_unfinished_requests():
            self._wake.clear()
            await self._wake.wait()
            return None
        running = self._submit(loop, self.scheduler.schedule())
        if running is None:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _IDLE_POLL_S)
        return running

    def _submit(self, loop: asyncio.AbstractEventLoop, step: SchedulerOutput) -> _Running | None:
        """Queue ``step`` in the step thread; None for a step with nothing to run (it
        carries no finished ids either, so skipping it loses nothing)."""
        if step.is_empty and not step.finished_req_ids:
            return None
        if self._split is not None:
            launched = self.executor.submit(self._split.launch, step)
            return _Running(step, None, time.perf_counter(), launched)
        if self.inline:
            return self._run_inline(loop, step)
        future = loop.run_in_executor(self.executor, self.runner.execute_model, step)
        return _Running(step, future, time.perf_counter())

    def _run_inline(self, loop: asyncio.AbstractEventLoop, step: SchedulerOutput) -> _Running:
        """Run ``step`` now, on this thread (:attr:`inline`); its result (or the runner's
        exception, raised again where the loop awaits it) in a completed future."""
        started = time.perf_counter()
        future: asyncio.Future[RunnerOutput] = loop.create_future()
        try:
            future.set_result(self.runner.execute_model(step))
        except Exception as exc:
            future.set_exception(exc)
        return _Running(step, future, started)

    def _result(
        self, loop: asyncio.AbstractEventLoop, running: _Running
    ) -> asyncio.Future[RunnerOutput]:
        """``running``'s result; for a launched step, its collect is queued in the step
        thread now — after the step scheduled ahead of it was launched, so the runner
        queues step n + 1 on the device before it waits for step n's readback.  (A launch
        that raised raises again here, as the step's failure.)"""
        if running.future is None:
            split, launched = self._split, running.launched
            assert split is not None and launched is not None
            running.future = loop.run_in_executor(
                self.executor, lambda: split.collect(launched.result())
            )
        return running.future

    def _emit_step(self, done: _Finished) -> None:
        """Detokenise a finished step's tokens (stop strings), hand them and the step's
        observation to the gRPC loop in one delivery."""
        num_finished = self._process_outputs(done.outputs)
        spec_ids = {c.req_id for c in done.step.chunks if c.num_draft_tokens}
        observation = StepObservation(
            step=done.step,
            duration_s=done.duration_s,
            num_finished=num_finished,
            num_spec_tokens=Counter(t.req_id for t in done.result.sampled if t.req_id in spec_ids)
            if spec_ids
            else {},
            ended_s=done.ended_s,
        )
        self._flush(observation)

    def _flush(self, observation: StepObservation | None = None) -> None:
        if self._outbox or observation is not None:
            outputs, self._outbox = self._outbox, []
            self._deliver(Delivery(outputs, observation))

    def _on_step_failure(self, step: SchedulerOutput, exc: Exception) -> None:
        is_alive = getattr(self.runner, "is_alive", None)
        if callable(is_alive) and not is_alive():
            self.die(f"model runner died: {exc}")
            return
        log.exception("step_failed", step_id=step.step_id, num_requests=len(step.chunks))
        self.scheduler.abandon_step(step)
        failed = [c.req_id for c in step.chunks]
        self.scheduler.finish_requests(failed, FinishReason.ERROR)
        for req_id in failed:
            self._end_stream(req_id, FinishReason.ERROR, error=f"generation failed: {exc}")
        self._flush()

    def _process_outputs(self, outputs: list[EngineCoreOutput]) -> int:
        num_finished = 0
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.req_id)
            if stream is None:  # aborted while its step was running
                continue
            if out.prompt_logprobs is not None:
                self._add_prompt_logprobs(stream, out.prompt_logprobs)
            if out.new_token is None:
                if out.finish_reason is not None:
                    self._end_stream(out.req_id, out.finish_reason, cached=out.num_cached_tokens)
                    num_finished += 1
                continue
            if self._emit_token(stream, out):
                num_finished += 1
        return num_finished

    def _emit_token(self, stream: _Stream, out: EngineCoreOutput) -> bool:
        """Detokenise one sampled token and queue its output; True when it ended the
        request.  Runs once per row a step: kept to plain local work (no per-token objects
        beyond the output itself, no text search for a request without stop strings)."""
        sampled = out.new_token
        assert sampled is not None
        token_id = sampled.token_id
        detok = stream.detokenizer
        finish = out.finish_reason
        # EOS / a stop token id that ended generation (vLLM leaves its text out by default).
        ends = finish is FinishReason.EOS_TOKEN or finish is FinishReason.STOP_SEQUENCE
        text = detok.add(token_id, ends_generation=ends)
        if detok.stopped_by is not None:
            if finish is None:
                self.scheduler.finish_requests([out.req_id], FinishReason.STOP_SEQUENCE)
            finish = FinishReason.STOP_SEQUENCE
        elif finish is not None:
            text += detok.flush()
        token = token_info(self._tokenizer, token_id, sampled.logprob, text)
        top = top_infos(self._tokenizer, sampled.top_tokens) if sampled.top_tokens else ()
        index = stream.num_generated
        stream.num_generated = index + 1
        stream.texts.append(text)
        final = None
        if finish is not None:
            final = self._final_info(stream, finish, out.num_cached_tokens, out.num_preemptions)
            del self._streams[out.req_id]
        self._outbox.append((out.req_id, TokenOutput(index, token, top, final)))
        return final is not None

    def _end_stream(
        self,
        req_id: str,
        reason: FinishReason,
        *,
        error: str | None = None,
        cached: int = 0,
    ) -> None:
        stream = self._streams.pop(req_id, None)
        if stream is None:
            return
        final = self._final_info(stream, reason, cached, 0, error=error)
        self._outbox.append(
            (req_id, TokenOutput(index=stream.num_generated, token=None, final=final))
        )

    def _final_info(
        self,
        stream: _Stream,
        reason: FinishReason,
        num_cached_tokens: int,
        num_preemptions: int,
        *,
        error: str | None = None,
    ) -> FinalInfo:
        req = stream.request
        prefill: tuple[TokenInfo, ...] = ()
        prefill_top: tuple[tuple[TokenInfo, ...], ...] = ()
        if req.sampling.prompt_logprobs:
            prefill, prefill_top = prefill_infos(
                self._tokenizer, req.prompt_token_ids, stream.prompt_logprobs, stream.prompt_top
            )
        return FinalInfo(
            finish_reason=reason,
            generated_text="".join(stream.texts),
            num_generated_tokens=stream.num_generated,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_tokens=num_cached_tokens,
            num_preemptions=num_preemptions,
            prefill=prefill,
            prefill_top=prefill_top,
            error=error,
        )

    @staticmethod
    def _add_prompt_logprobs(stream: _Stream, chunk: PromptLogprobs) -> None:
        # Recomputed chunks (after preemption) send positions again: same values, keep one.
        for offset, entry in enumerate(chunk.logprobs):
            stream.prompt_logprobs[chunk.first_pos + offset] = entry.logprob
        for offset, top in enumerate(chunk.top):
            stream.prompt_top[chunk.first_pos + offset] = top
