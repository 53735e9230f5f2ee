"""The asyncio facade over the scheduler and a Runner: one engine loop, many request streams.

The loop runs in the event-loop thread except for ``Runner.execute_model``, which runs in a
single worker thread so that gRPC I/O keeps flowing while the model computes (torch releases
the GIL inside its kernels).  Scheduler state is only touched from the event-loop thread, so
aborts and new arrivals need no locks.

With ``overlap`` (issue #29, see docs/overlap-scheduling.md) step n + 1 is scheduled and
handed to the runner thread *before* step n's tokens are known, whenever the scheduler
allows it (:meth:`Scheduler.can_schedule_ahead`) and the runner fills placeholder tokens
(``supports_token_from_last_step``): the runner thread goes from step n straight into
step n + 1, and the host's work on step n (applying its tokens and stop conditions,
detokenising, stop strings, streaming, observers) runs while step n + 1 computes.  Where
the next step cannot be scheduled ahead (drafts, grammars, a runner without placeholders)
it is scheduled right after step n's result is applied and before step n is streamed, so
streaming still overlaps the device.  Outputs are the same with and without ``overlap``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import structlog

from genserve.engine.adapter_manager import AdapterManager
from genserve.engine.outputs import FinalInfo, GenerationRequest, TokenInfo, TokenOutput
from genserve.engine.request import FinishReason, Request
from genserve.engine.scheduler import EngineCoreOutput, Scheduler
from genserve.engine.token_info import prefill_infos, token_info, top_infos
from genserve.model.adapter_files import AdapterNotFoundError
from genserve.step import (
    AdapterRef,
    PromptLogprobs,
    Runner,
    RunnerOutput,
    SchedulerOutput,
    TokenLogprob,
)
from genserve.tokenizer import IncrementalDetokenizer, Tokenizer

log = structlog.get_logger(__name__)

# How long the loop sleeps when requests wait but none can be scheduled (blocks held by a
# step in flight are released by the next update); short, so arrivals are not delayed.
_IDLE_POLL_S = 0.005


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests: still loading, shutting down, or a shard died."""


@dataclass(slots=True)
class _Stream:
    """Per-request output state, owned by the event-loop thread."""

    request: GenerationRequest
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue[TokenOutput] = field(default_factory=asyncio.Queue)
    texts: list[str] = field(default_factory=list)
    num_generated: int = 0
    prompt_logprobs: dict[int, float] = field(default_factory=dict)
    prompt_top: dict[int, tuple[TokenLogprob, ...]] = field(default_factory=dict)  # #27
    finished: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


@dataclass(frozen=True, slots=True)
class StepObservation:
    """What one engine step did, for metrics and traces."""

    step: SchedulerOutput
    duration_s: float
    num_finished: int
    # Tokens each request of a speculative chunk received (one per other sampling chunk).
    num_spec_tokens: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Running:
    """A step handed to the runner thread, its result still to come."""

    step: SchedulerOutput
    future: asyncio.Future[RunnerOutput]
    started: float


@dataclass(frozen=True, slots=True)
class _Finished:
    """A step the scheduler has updated, waiting to be streamed (with ``overlap``)."""

    step: SchedulerOutput
    result: RunnerOutput
    outputs: list[EngineCoreOutput]
    duration_s: float


class AsyncEngine:
    """Drives a :class:`Scheduler` and a :class:`Runner`; serves token streams per request."""

    def __init__(
        self, scheduler: Scheduler, runner: Runner, tokenizer: Tokenizer, overlap: bool = False
    ) -> None:
        """``overlap``: schedule step n + 1 before step n's tokens are known and stream step
        n while step n + 1 runs (see the module docstring and :meth:`_run`)."""
        self.overlap = overlap
        # Scheduling ahead needs a runner that fills placeholder tokens from its last step.
        self.schedule_ahead = overlap and bool(
            getattr(runner, "supports_token_from_last_step", False)
        )
        self._scheduler = scheduler
        self._runner = runner
        self._tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="genserve-step")
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._accepting = False
        self._dead_reason: str | None = None
        self._idle = asyncio.Event()  # set whenever the last stream ends
        self._drain_cut = False  # end_drain: shutdown aborts in-flight requests at once
        self.step_observers: list[Callable[[StepObservation], None]] = []
        # LoRA adapters (set by the launcher); None: requests naming an adapter are refused.
        self.adapters: AdapterManager | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine loop and accept requests.  Call from the running event loop."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(
                self._run(), name="genserve-engine-loop"
            )
        self._accepting = True

    @property
    def is_ready(self) -> bool:
        """True when a request sent now would be generated."""
        return (
            self._accepting
            and self._dead_reason is None
            and self._loop_task is not None
            and not self._loop_task.done()
        )

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def scheduler(self) -> Scheduler:
        return self._scheduler

    def stop_accepting(self) -> None:
        self._accepting = False

    def end_drain(self) -> None:
        """Stop waiting for in-flight requests (a second SIGTERM/SIGINT): a shutdown under
        way, or the next one, aborts them now (their calls end UNAVAILABLE)."""
        self._drain_cut = True
        self._idle.set()

    def mark_dead(self, reason: str) -> None:
        """A part the engine depends on (a shard worker) is gone: fail every request now.

        Safe to call from any thread."""
        try:
            loop = self._loop_task.get_loop() if self._loop_task else None
        except RuntimeError:
            loop = None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._die, reason)
        else:
            self._die(reason)

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._accepting = False
        log.error("engine_dead", reason=reason)
        self._fail_all(FinishReason.ERROR, reason)
        self._wake.set()

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace_s``, abort the rest,
        stop the loop and the runner."""
        self._accepting = False
        if self._streams and self._dead_reason is None and not self._drain_cut:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), max(0.0, grace_s))
        if self._streams:
            log.warning("shutdown_aborting_requests", num_requests=len(self._streams))
            self._fail_all(FinishReason.ABORTED, "server is shutting down")
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._runner.shutdown)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- requests
    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenOutput]:
        """Yield the request's tokens as they are generated; the last output has ``final``.

        Closing the iterator early (client gone, deadline) aborts the request: it leaves the
        batch at the next step and its KV blocks return to the pool."""
        if not self.is_ready:
            raise EngineUnavailableError(self._dead_reason or "the engine is not serving")
        if req.req_id in self._streams:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        adapter = await self._acquire_adapter(req.adapter_id)
        num_generated = 0
        try:
            async for out in self._generate(req, adapter):
                num_generated += out.token is not None
                yield out
        finally:
            if adapter is not None and self.adapters is not None:
                self.adapters.release(adapter, num_generated)

    async def _acquire_adapter(self, requested: str | None) -> AdapterRef | None:
        """The request's LoRA adapter pinned into a runner slot (loaded off this loop's
        critical path: validation runs in a thread while the batch keeps stepping)."""
        adapter_id = self.adapters.effective_id(requested) if self.adapters else requested
        if not adapter_id:
            return None
        if self.adapters is None:
            raise AdapterNotFoundError(f"adapter {adapter_id!r}: LoRA is not enabled")
        ref = await self.adapters.acquire(adapter_id)
        # Read and lay the adapter out for its slot in a thread now, so the step that first
        # runs it only copies tensors (a runner without the hook loads it on that step).
        prepare = getattr(self._runner, "prepare_adapter", None)
        if prepare is not None:
            try:
                await asyncio.to_thread(prepare, ref)
            except BaseException:
                self.adapters.release(ref)
                raise
        return ref

    async def _generate(
        self, req: GenerationRequest, adapter: AdapterRef | None
    ) -> AsyncIterator[TokenOutput]:
        stream = _Stream(
            request=req,
            detokenizer=self._tokenizer.detokenizer(
                req.prompt_token_ids,
                req.stop,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str=req.include_stop_str_in_output,
            ),
        )
        self._streams[req.req_id] = stream
        self._scheduler.add_request(
            Request(
                req_id=req.req_id,
                prompt_token_ids=list(req.prompt_token_ids),
                sampling=req.sampling,
                stopping=req.stopping,
                grammar=req.grammar.new_state() if req.grammar is not None else None,
                # The adapter is part of every block hash: the same prompt under two
                # adapters never shares KV.
                cache_salt=f"lora:{adapter.adapter_id}" if adapter else None,
                adapter=adapter,
                fork_of=req.fork_of,
            )
        )
        self._wake.set()
        try:
            while True:
                out = await stream.queue.get()
                yield out
                if out.final is not None:
                    return
        finally:
            if not stream.finished:
                self.abort(req.req_id)

    def abort(self, req_id: str) -> None:
        """End a request now (cancellation, deadline); a no-op for unknown/finished ids."""
        stream = self._pop_stream(req_id)
        if stream is None:
            return
        stream.finished = True
        self._scheduler.finish_requests([req_id], FinishReason.ABORTED)
        log.info("request_aborted", req_id=req_id, generated_tokens=stream.num_generated)

    def _pop_stream(self, req_id: str) -> _Stream | None:
        stream = self._streams.pop(req_id, None)
        if not self._streams:
            self._idle.set()
        return stream

    # ----------------------------------------------------------------- the loop
    async def _run(self) -> None:
        """schedule → run (in the step thread) → apply the result → stream.

        With ``overlap``: while step n runs, step n + 1 is scheduled ahead of it when the
        scheduler allows (its decode tokens are placeholders the runner fills from step n's
        sampled ids on the device) and queued in the runner thread, so the runner never
        waits for the host.  Step n's result is applied when it arrives (stop conditions one
        step late: a request that ended then has its token from step n + 1 dropped) and
        streamed while step n + 1 runs.  Where scheduling ahead is not allowed, step n + 1
        is scheduled after step n's result is applied, then step n is streamed while it
        runs.  Without ``overlap`` every step is streamed before the next is scheduled."""
        loop = asyncio.get_running_loop()
        running: _Running | None = None
        while self._dead_reason is None:
            if running is None:
                running = await self._next_step(loop)
                if running is None:
                    continue
            ahead: _Running | None = None
            if self.schedule_ahead and self._scheduler.can_schedule_ahead(running.step):
                ahead = self._submit(loop, self._scheduler.schedule())
            try:
                result = await running.future
                outputs = self._scheduler.update_from_output(running.step, result)
            except Exception as exc:  # the runner failed: fail this step's requests
                self._on_step_failure(running.step, exc)
                running = ahead
                continue
            done = _Finished(running.step, result, outputs, time.perf_counter() - running.started)
            if self.overlap and ahead is None and self._scheduler.has_unfinished_requests():
                ahead = self._submit(loop, self._scheduler.schedule())
            self._emit_step(done)  # the host's work, while the step ahead runs
            running = ahead

    async def _next_step(self, loop: asyncio.AbstractEventLoop) -> _Running | None:
        """Schedule and submit a step with nothing in flight; None after waiting (no
        request, or nothing runnable now)."""
        if not self._scheduler.has_unfinished_requests():
            self._wake.clear()
            await self._wake.wait()
            return None
        running = self._submit(loop, self._scheduler.schedule())
        if running is None:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _IDLE_POLL_S)
        return running

    def _submit(self, loop: asyncio.AbstractEventLoop, step: SchedulerOutput) -> _Running | None:
        """Queue ``step`` in the runner thread; None for a step with nothing to run (it
        carries no finished ids either, so skipping it loses nothing)."""
        if step.is_empty and not step.finished_req_ids:
            return None
        future = loop.run_in_executor(self._executor, self._runner.execute_model, step)
        return _Running(step, future, time.perf_counter())

    def _emit_step(self, done: _Finished) -> None:
        """Stream a finished step's tokens and tell the observers."""
        num_finished = self._process_outputs(done.outputs, done.result)
        spec_ids = {c.req_id for c in done.step.chunks if c.num_draft_tokens}
        observation = StepObservation(
            step=done.step,
            duration_s=done.duration_s,
            num_finished=num_finished,
            num_spec_tokens=Counter(t.req_id for t in done.result.sampled if t.req_id in spec_ids)
            if spec_ids
            else {},
        )
        for observer in self.step_observers:
            observer(observation)

    def _on_step_failure(self, step: SchedulerOutput, exc: Exception) -> None:
        is_alive = getattr(self._runner, "is_alive", None)
        if callable(is_alive) and not is_alive():
            self._die(f"model runner died: {exc}")
            return
        log.exception("step_failed", step_id=step.step_id, num_requests=len(step.chunks))
        self._scheduler.abandon_step(step)
        failed = [c.req_id for c in step.chunks]
        self._scheduler.finish_requests(failed, FinishReason.ERROR)
        for req_id in failed:
            self._end_stream(req_id, FinishReason.ERROR, error=f"generation failed: {exc}")

    def _fail_all(self, reason: FinishReason, message: str) -> None:
        ids = list(self._streams)
        self._scheduler.finish_requests(ids, reason)
        for req_id in ids:
            self._end_stream(req_id, reason, error=message)

    def _process_outputs(self, outputs: list[EngineCoreOutput], result: RunnerOutput) -> int:
        del result  # everything needed travels in the scheduler's outputs
        num_finished = 0
        for out in outputs:
            stream = self._streams.get(out.req_id)
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
        assert out.new_token is not None
        sampled = out.new_token
        detok = stream.detokenizer
        finish = out.finish_reason
        # EOS / a stop token id that ended generation (vLLM leaves its text out by default).
        ends = finish in (FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE)
        text = detok.add(sampled.token_id, ends_generation=ends)
        if detok.stopped_by is not None:
            if finish is None:
                self._scheduler.finish_requests([out.req_id], FinishReason.STOP_SEQUENCE)
            finish = FinishReason.STOP_SEQUENCE
        elif finish is not None:
            text += detok.flush()
        token = token_info(self._tokenizer, sampled.token_id, sampled.logprob, text)
        top = top_infos(self._tokenizer, sampled.top_tokens)
        index = stream.num_generated
        stream.num_generated += 1
        stream.texts.append(text)
        if stream.first_token_time is None:
            stream.first_token_time = time.monotonic()
        final = None
        if finish is not None:
            final = self._final_info(stream, finish, out.num_cached_tokens, out.num_preemptions)
            stream.finished = True
            self._pop_stream(out.req_id)
        stream.queue.put_nowait(TokenOutput(index=index, token=token, top_tokens=top, final=final))
        return final is not None

    def _end_stream(
        self,
        req_id: str,
        reason: FinishReason,
        *,
        error: str | None = None,
        cached: int = 0,
    ) -> None:
        stream = self._pop_stream(req_id)
        if stream is None:
            return
        stream.finished = True
        final = self._final_info(stream, reason, cached, 0, error=error)
        stream.queue.put_nowait(TokenOutput(index=stream.num_generated, token=None, final=final))

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
