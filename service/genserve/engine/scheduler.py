"""Continuous batching by token budget, with preemption and prefix reuse.  Pure Python.

Every request carries ``num_computed_tokens``: the positions whose KV sits in its blocks.  A
step gives each scheduled request a chunk ``all_token_ids[num_computed : num_computed + n]``;
when the chunk reaches the end of the known sequence the runner samples the next token.  So
prefill, chunked prefill, decode and recomputation after preemption are the same operation,
and mixed prefill + decode steps need no special case.  After a token is sampled,
``num_computed_tokens == num_tokens - 1`` (the new token's KV is computed next step).

Step construction (:meth:`Scheduler.schedule`):

1. Running requests, oldest first: decodes (one token each, not budgeted) and prompt chunks
   (under ``max_batch_prefill_tokens`` per step and ``max_chunk_tokens`` per request).  When
   a block is missing the newest running request is preempted (blocks freed, recomputed
   later, back to the front of the queue) until the allocation succeeds; a request that is
   itself the newest preempts itself and waits.
2. Waiting requests, in policy order (fcfs, or lpm: longest cached prefix first), while the
   prefill budget, ``max_num_running`` and free blocks allow, keeping free the blocks the
   running requests are expected to grow into (``growth_reserve_ratio``) so that admissions
   are seldom undone by preemption.  The queue head blocks the rest (no overtaking), and
   nothing is admitted in a step that had to preempt.  With chunked
   prefill disabled, a prompt is prefilled whole, and TGI's rule decides whether a new
   prefill batch may join a running one (``waiting_served_ratio``, ``max_waiting_tokens``).

Speculative decoding (``num_speculative_tokens > 0``): while the batch is small, a decoding
request's chunk is its last token followed by n-gram draft tokens (see
:mod:`genserve.engine.speculative`; a request whose drafts keep missing stops drafting
for a while); the runner returns the drafts it accepted and one more
token, and ``num_computed_tokens`` advances past the accepted ones only.  Slots written for
rejected drafts lie beyond ``num_computed_tokens`` and are overwritten later.  Drafts never
cause a preemption: without free blocks for them the request decodes one token.

Parts: this module owns the queues, request states and step assembly; which waiting
requests join a step is :mod:`~genserve.engine.admission`'s decision (with
:mod:`~genserve.engine.adapter_cycling` for LoRAX's adapter turns, and
:mod:`~genserve.engine.scheduler_policy` for ordering and growth estimates); what a request
runs in a step is cut by :mod:`~genserve.engine.step_chunks`.  Past ~500 lines (~620, most
of it the overlapped-scheduling bookkeeping below) on purpose: it is the state machine and
the step it builds, kept in one place because every change of a request's state happens
here.

Overlapped scheduling (issue #29, vLLM's async scheduling, SGLang's overlap loop): one step
may be scheduled while the previous one is still in flight, when
:meth:`Scheduler.can_schedule_ahead` allows it.  Positions scheduled but not yet confirmed
are ``num_in_flight_tokens`` of a request, and a token being sampled is one of its
``num_pending_outputs``; the step ahead gives such a request its next decode token as a
placeholder the runner fills from the device (``ScheduledChunk.token_from_last_step``).
Stop conditions are applied when the result arrives, one step late; a request that
finished then (EOS, stop id, stop string, cancellation) has its token from the step ahead
dropped when that step's result arrives, its blocks already freed.  A request whose pending
token reaches ``max_new_tokens`` is not scheduled ahead (it is known to end), and neither
are drafts: a step in flight with drafts or with a constrained (grammar) request is not
scheduled ahead at all, since the number of accepted tokens, or the next grammar mask, is
only known from its result; nor is any step while the batch is small enough to speculate
(the proposer needs every token so far).  Speculation thus turns overlap off while it is in
use, and large batches, which do not speculate, overlap.

Threading: one owner.  ``finish_requests`` may be called while the runner executes a step
(the engine serialises calls onto its loop); ``schedule`` may be called once more before
that step's ``update_from_output`` only when :meth:`Scheduler.can_schedule_ahead` says so.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from genserve.engine import rotary_salt
from genserve.engine.adapter_cycling import AdapterCycler
from genserve.engine.admission import Admission, choose_admissions
from genserve.engine.request import FinishReason, Request, RequestStatus, stop_reason
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.engine.scheduler_output import EngineCoreOutput, SchedulerStats
from genserve.engine.scheduler_policy import AdmissionPolicy
from genserve.engine.speculative import DraftLengthController, NgramProposer
from genserve.engine.step_chunks import plain_chunk, speculative_chunk
from genserve.kv_cache.manager import KVCacheManager
from genserve.step import (
    NewRequestData,
    PromptLogprobs,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from genserve.engine.grammar import BitmaskFiller

__all__ = ["EngineCoreOutput", "Scheduler", "SchedulerConfig", "SchedulerStats"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A step scheduled whose result is not applied yet: the request objects it ran (a
    request id may be reused after its request ended), and whether the next step may be
    scheduled before its result (no drafts, no constrained request sampled)."""

    step_id: int
    allows_ahead: bool
    requests: dict[str, Request]


class Scheduler:
    """Owns the request queues and the KV-cache manager; see the module docstring."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager | None = None) -> None:
        self.config = config
        self.kv = kv_cache or KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching
        )
        if (self.kv.num_blocks, self.kv.block_size) != (config.num_blocks, config.block_size):
            raise ValueError("kv_cache geometry differs from the scheduler config")
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # oldest arrival first
        self._arrival_seq: dict[str, int] = {}
        self._next_arrival_seq = 0
        self._step_id = 0
        self._runner_known: set[str] = set()  # requests the runner holds state for
        self._finished_for_runner: list[str] = []
        # Next prompt position whose logprob the engine has not received (recomputation
        # after preemption produces them again).
        self._next_prompt_logprob_pos: dict[str, int] = {}
        self._policy = AdmissionPolicy(config)
        self._num_preemptions = 0
        self._last_step = (0, 0, 0)
        self._proposer = NgramProposer(config.speculate_ngram_max, config.speculate_ngram_min)
        self._draft_lengths = DraftLengthController(config.num_speculative_tokens)
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._cycler = AdapterCycler(config)  # LoRA adapter cycling
        self.clock: Callable[[], float] = time.monotonic  # tests substitute their own
        self._mask_filler: BitmaskFiller | None = None  # made on the first constrained step
        # Steps scheduled whose results are not applied yet, oldest first (at most two).
        self._in_flight: list[_InFlight] = []

    # ---- queries --------------------------------------------------------------------------

    @property
    def max_tokens_per_request(self) -> int:
        """``prompt + max_new_tokens`` may not exceed this (the whole KV capacity);
        :meth:`add_request` rejects larger requests, the engine should validate first."""
        return self.kv.max_num_tokens

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def can_schedule_ahead(self, in_flight: SchedulerOutput) -> bool:
        """Whether the next step may be scheduled before ``in_flight``'s result is applied:
        it is the only step in flight, and none of its chunks has drafts (how many are
        accepted decides where the next chunk starts) or samples for a constrained request
        (the next grammar mask needs the token)."""
        return (
            len(self._in_flight) == 1
            and self._in_flight[0].step_id == in_flight.step_id
            and self._in_flight[0].allows_ahead
            and not self._would_speculate()
        )

    def _would_speculate(self) -> bool:
        """Whether the next step may give drafts (a step ahead never does, so while the
        batch is small enough to speculate, steps are not scheduled ahead)."""
        return (
            self.config.num_speculative_tokens > 0
            and len(self._running) <= self.config.speculate_max_batch_size
        )

    def abandon_step(self, step: SchedulerOutput) -> None:
        """Forget ``step`` (in flight, oldest) without a result: its runner failed.  The
        caller ends its requests (:meth:`finish_requests`); a step ahead of it stays."""
        if self._in_flight and self._in_flight[0].step_id == step.step_id:
            for chunk in step.chunks:
                req = self._in_flight[0].requests[chunk.req_id]
                if req.status is RequestStatus.RUNNING:
                    req.num_in_flight_tokens -= len(chunk.token_ids)
                    req.num_pending_outputs -= chunk.sample
            del self._in_flight[0]

    def get_request(self, req_id: str) -> Request | None:
        """The unfinished request with this id, if any."""
        return self._requests.get(req_id)

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        return SchedulerStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_used_blocks=kv.num_used_blocks,
            num_total_blocks=kv.num_total_blocks,
            kv_usage=kv.usage,
            num_preemptions=self._num_preemptions,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            last_step_num_reqs=self._last_step[0],
            last_step_num_tokens=self._last_step[1],
            last_step_num_prefill_tokens=self._last_step[2],
            growth_reserve_ratio=self._policy.growth_ratio,
            spec_draft_tokens=self._num_draft_tokens,
            spec_accepted_tokens=self._num_accepted_tokens,
        )

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if queues, request states and KV ownership disagree
        (tests, debugging).  Valid between steps."""
        self.kv.check_invariants()
        running = {r.req_id for r in self._running}
        waiting = {r.req_id for r in self._waiting}
        if len(running) != len(self._running) or len(waiting) != len(self._waiting):
            raise RuntimeError("a request is queued twice")
        if running & waiting or (running | waiting) != set(self._requests):
            raise RuntimeError("queues and the request table disagree")
        if running != self._runner_known:
            raise RuntimeError("the runner's request set differs from the running set")
        seqs = [self._arrival_seq[r.req_id] for r in self._running]
        if seqs != sorted(seqs):
            raise RuntimeError("running requests are not in arrival order")
        for req in self._running:
            held = self.kv.num_owned_blocks(req.req_id) * self.kv.block_size
            if req.status is not RequestStatus.RUNNING or held < req.num_scheduled_tokens:
                raise RuntimeError(
                    f"{req.req_id}: running with {held} slots, {req.num_scheduled_tokens} "
                    "computed or in flight"
                )
            if not 0 <= req.num_computed_tokens < req.num_tokens:
                raise RuntimeError(f"{req.req_id}: num_computed_tokens out of range")
        for req in self._waiting:
            if req.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise RuntimeError(f"{req.req_id}: waiting with status {req.status}")
            if req.num_scheduled_tokens or self.kv.num_owned_blocks(req.req_id):
                raise RuntimeError(f"{req.req_id}: waiting but holds KV")
            if req.num_pending_outputs:
                raise RuntimeError(f"{req.req_id}: waiting with a token pending")

    # ---- requests in and out --------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a new request (status WAITING, nothing computed).  It is considered from the
        next :meth:`schedule` on.  Raises ``ValueError`` for an id already in use, an empty
        prompt, ``max_new_tokens < 1``, or a request larger than the KV capacity."""
        if req.req_id in self._requests:
            raise ValueError(f"request id {req.req_id!r} is already in use")
        self.check_request(req)
        if self.config.length_rotary is not None:
            regime = self.config.length_rotary.salt(len(req.prompt_token_ids))
            req.cache_salt = rotary_salt.combine(req.cache_salt, regime)
        self._requests[req.req_id] = req
        self._arrival_seq[req.req_id] = self._next_arrival_seq
        self._next_arrival_seq += 1
        self._next_prompt_logprob_pos[req.req_id] = 1  # position 0 never has a logprob
        self._waiting.append(req)

    def check_request(self, req: Request) -> None:
        """The checks of :meth:`add_request` that need no scheduler state (only the fixed KV
        capacity): safe from any thread, so a front end on another thread can refuse a bad
        request to its caller before queueing it.  Raises ``ValueError``."""
        check_request(req, self.max_tokens_per_request)

    def finish_requests(self, req_ids: Iterable[str], reason: FinishReason) -> None:
        """End requests now (stop string, cancellation, deadline, shutdown, runner error),
        wherever they are; their blocks return to the pool at once.  Unknown or already
        finished ids are ignored.  A request in the step being executed gets no output from
        that step."""
        for req_id in req_ids:
            req = self._requests.get(req_id)
            if req is None:
                continue
            if req.status is RequestStatus.RUNNING:
                self._running.remove(req)
            else:
                self._waiting.remove(req)
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished and release everything; the caller took it out of its queue."""
        self._policy.on_finish(req, reason)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.num_in_flight_tokens = req.num_pending_outputs = 0  # their results are dropped
        del self._requests[req.req_id]
        del self._arrival_seq[req.req_id]
        del self._next_prompt_logprob_pos[req.req_id]
        self._proposer.forget(req.req_id)
        self._draft_lengths.forget(req.req_id)
        self._forget_in_runner(req.req_id)

    def _forget_in_runner(self, req_id: str) -> None:
        if req_id in self._runner_known:
            self._runner_known.remove(req_id)
            self._finished_for_runner.append(req_id)

    def _preempt(self, req: Request) -> None:
        """Take ``req``'s blocks back; it is recomputed when readmitted.  The caller removed
        it from the running list."""
        # Its full blocks stay hashed on the free list: unless evicted meanwhile, the
        # recomputation is mostly a prefix-cache hit.
        self.kv.free(req, keep_block_hashes=True)
        req.num_computed_tokens = 0
        # A token being sampled for it is dropped with the step's result: the recomputation
        # samples it again (the same token: sampling depends on the sequence, seed and index).
        req.num_in_flight_tokens = req.num_pending_outputs = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self._num_preemptions += 1
        self._waiting.appendleft(req)
        self._forget_in_runner(req.req_id)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring).  The result may have no chunks
        (nothing runnable); then it also carries no ``finished_req_ids``: those wait for the
        next step with chunks, so an engine may skip running empty steps.  With a step in
        flight (see :meth:`can_schedule_ahead`) this is the step ahead of it."""
        if self._in_flight and (len(self._in_flight) > 1 or not self._in_flight[0].allows_ahead):
            raise RuntimeError("schedule() called with a step in flight that forbids it")
        ahead = bool(self._in_flight)
        self._step_id += 1
        chunks: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []
        budget = self.config.max_batch_prefill_tokens
        had_running = bool(self._running)

        preempted = False
        # A step ahead never drafts: the proposer needs the token still being sampled.
        speculate = not ahead and self._would_speculate()
        i = 0
        while i < len(self._running):
            req = self._running[i]
            num_new = self._num_tokens_to_schedule(req, budget)
            if num_new == 0:
                i += 1
                continue
            if speculate and num_new == 1:
                # Blocks for the drafts must leave one free for every request after this
                # one, or drafts could force a preemption later in this loop.
                spec_chunk = speculative_chunk(
                    req, self.kv, self._proposer, self._draft_lengths, len(self._running) - i - 1
                )
                if spec_chunk is not None:
                    chunks.append(spec_chunk)
                    i += 1
                    continue
            # Slots count from the computed positions: those in flight need theirs too.
            while self.kv.allocate_slots(req, req.num_in_flight_tokens + num_new) is None:
                preempted = True
                victim = self._running.pop()  # newest arrival
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself: it was the newest, nothing follows
            if num_new > 1:
                budget -= num_new
            chunks.append(plain_chunk(req, num_new, self.kv))
            i += 1

        admitted = False
        if not preempted and self._waiting:
            num_admitted_tokens = self._admit(budget, chunks, new_requests)
            admitted = num_admitted_tokens > 0
            budget -= num_admitted_tokens
        self._policy.on_step(had_running, admitted)

        finished: tuple[str, ...] = ()
        if chunks:
            finished = tuple(self._finished_for_runner)
            self._finished_for_runner.clear()
        num_tokens = sum(len(c.token_ids) for c in chunks)
        num_prefill = self.config.max_batch_prefill_tokens - budget
        self._last_step = (len(chunks), num_tokens, num_prefill)
        bitmask, grammar_ids = self._grammar_bitmask(chunks)
        allows_ahead = not grammar_ids
        for c in chunks:
            req = self._requests[c.req_id]
            req.num_in_flight_tokens += len(c.token_ids)
            req.num_pending_outputs += c.sample
            allows_ahead = allows_ahead and not c.num_draft_tokens
        if chunks:
            requests = {c.req_id: self._requests[c.req_id] for c in chunks}
            self._in_flight.append(_InFlight(self._step_id, allows_ahead, requests))
        return SchedulerOutput(
            step_id=self._step_id,
            chunks=tuple(chunks),
            new_requests=tuple(new_requests),
            finished_req_ids=finished,
            grammar_bitmask=bitmask,
            grammar_req_ids=grammar_ids,
        )

    def _grammar_bitmask(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[object | None, tuple[str, ...]]:
        """One packed bitmask row per sampling chunk of a constrained request, filled for all
        of them in one call in the grammar thread while the forward runs (a
        :class:`~genserve.engine.grammar.PendingBitmask`; the runner waits for it)."""
        states = []
        req_ids = []
        for c in chunks:
            grammar = self._requests[c.req_id].grammar
            if c.sample and grammar is not None:
                states.append(grammar)
                req_ids.append(c.req_id)
        if not states:
            return None, ()
        if self._mask_filler is None:
            from genserve.engine.grammar import BitmaskFiller  # only constrained steps pay

            self._mask_filler = BitmaskFiller()
        return self._mask_filler.submit(states), tuple(req_ids)

    def _num_tokens_to_schedule(self, req: Request, budget: int) -> int:
        """Tokens a running request gets this step: its decode token, or a prompt chunk
        within the budget (0 if the budget is spent, or if the token the step in flight
        samples for it is its last: it is known to end)."""
        if (
            req.num_pending_outputs
            and req.num_output_tokens + req.num_pending_outputs >= req.stopping.max_new_tokens
        ):
            return 0
        remaining = req.num_expected_tokens - req.num_scheduled_tokens
        if remaining <= 1:
            return remaining
        if not self.config.chunked_prefill_enabled:
            return remaining if remaining <= budget else 0
        return min(remaining, self.config.max_chunk_tokens, budget)

    # ---- admission ------------------------------------------------------------------------

    def _admit(
        self, budget: int, chunks: list[ScheduledChunk], new_requests: list[NewRequestData]
    ) -> int:
        """Admit waiting requests into this step (admission.py); returns the tokens scheduled
        for them."""
        cfg = self.config
        min_batch = self._policy.min_new_batch(len(self._running))
        if min_batch is not None and len(self._waiting) < min_batch:
            return 0
        self._waiting = self._policy.order_waiting(self._waiting, self.kv)
        slots = len(self._waiting)
        if cfg.max_num_running is not None:
            slots = min(slots, cfg.max_num_running - len(self._running))
        adapters = {r.adapter.adapter_id for r in self._running if r.adapter is not None}
        admissions = choose_admissions(
            self._waiting,
            self._running,
            self._requests,
            self.kv,
            self._policy,
            cfg,
            budget=budget,
            num_slots=slots,
            cycled_out=self._cycler.cycled_out(adapters, self._waiting, self.clock()),
            min_batch=min_batch,
        )
        for adm in admissions:
            self._start_running(adm, chunks, new_requests)
        return sum(adm.num_new_tokens for adm in admissions)

    def _start_running(
        self, adm: Admission, chunks: list[ScheduledChunk], new_requests: list[NewRequestData]
    ) -> None:
        req = adm.req
        self._waiting.remove(req)
        if req.status is RequestStatus.WAITING:  # first admission, not a resumption
            req.num_cached_tokens = adm.num_cached_tokens
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = adm.num_cached_tokens
        seq = self._arrival_seq[req.req_id]
        # Keep running sorted by arrival: preemption takes from the end.
        pos = len(self._running)
        while pos > 0 and self._arrival_seq[self._running[pos - 1].req_id] > seq:
            pos -= 1
        self._running.insert(pos, req)
        all_token_ids = tuple(req.all_token_ids)
        new_requests.append(
            NewRequestData(
                req_id=req.req_id,
                all_token_ids=all_token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                sampling=req.sampling,
                adapter=req.adapter,
            )
        )
        self._runner_known.add(req.req_id)
        chunks.append(plain_chunk(req, adm.num_new_tokens, self.kv))

    # ---- results --------------------------------------------------------------------------

    def update_from_output(
        self, step: SchedulerOutput, result: RunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply the runner's results of ``step``: advance ``num_computed_tokens``, append
        sampled tokens, cache newly full blocks, and finish requests on EOS
        (``stopping.eos_token_ids`` unless ``ignore_eos``) or ``max_new_tokens`` (length is
        checked first, as TGI does), freeing their blocks.  Requests finished while the step
        ran are skipped.  Raises ``RuntimeError`` before changing anything if the result does
        not match the step (the step is then abandoned, see :meth:`abandon_step`; the engine
        ends its requests with ERROR)."""
        if result.step_id != step.step_id:
            raise RuntimeError(f"result of step {result.step_id} given for step {step.step_id}")
        if not step.chunks:
            return []  # nothing ran (the engine does not run such steps)
        if not self._in_flight or self._in_flight[0].step_id != step.step_id:
            raise RuntimeError(f"step {step.step_id} is not the oldest step in flight")
        scheduled = self._in_flight[0].requests
        # One pass over the batch each, locals for what every row reads: this runs on the
        # engine thread once per step for every row (docs/overlap-scheduling.md).
        sampled: dict[str, list[SampledToken]] = {}
        for token in result.sampled:
            tokens_of = sampled.get(token.req_id)
            if tokens_of is None:
                sampled[token.req_id] = [token]
            else:
                tokens_of.append(token)
        prompt_logprobs = {p.req_id: p for p in result.prompt_logprobs}
        running = RequestStatus.RUNNING
        no_tokens: list[SampledToken] = []
        live: list[tuple[ScheduledChunk, Request, list[SampledToken]]] = []
        for chunk in step.chunks:
            req = scheduled[chunk.req_id]
            if req.status is not running:
                continue  # finished (e.g. aborted, stopped a step late) while the step ran
            if req.num_computed_tokens != chunk.start_pos:
                self.abandon_step(step)
                raise RuntimeError(f"{chunk.req_id}: step {step.step_id} is stale")
            tokens = sampled.get(chunk.req_id, no_tokens)
            num_tokens = len(tokens)
            if not chunk.sample <= num_tokens <= chunk.sample + chunk.num_draft_tokens:
                self.abandon_step(step)
                raise RuntimeError(
                    f"{chunk.req_id}: runner returned {num_tokens} tokens for a chunk with "
                    f"{chunk.num_draft_tokens} drafts in step {step.step_id}"
                )
            live.append((chunk, req, tokens))
        del self._in_flight[0]

        outputs: list[EngineCoreOutput] = []
        cache_blocks = self.kv.cache_blocks
        for chunk, req, tokens in live:
            num_chunk_tokens = len(chunk.token_ids)
            req.num_in_flight_tokens -= num_chunk_tokens
            req.num_pending_outputs -= chunk.sample
            reason: FinishReason | None = None
            kept = 0
            for token in tokens:
                req.output_token_ids.append(token.token_id)
                kept += 1
                if req.grammar is not None and not req.grammar.accept(token.token_id):
                    log.warning("grammar_rejected_token", req_id=req.req_id, token=token.token_id)
                reason = stop_reason(req, token.token_id)
                if reason is not None:
                    break  # tokens after a stop are dropped
            if chunk.num_draft_tokens:
                self._num_draft_tokens += chunk.num_draft_tokens
                self._num_accepted_tokens += len(tokens) - 1
                self._draft_lengths.record(req.req_id, chunk.num_draft_tokens, len(tokens) - 1)
                # The last token and the drafts that were kept have their KV now.
                req.num_computed_tokens += kept
            else:
                req.num_computed_tokens += num_chunk_tokens
            logprobs = (
                self._new_prompt_logprobs(req, prompt_logprobs.get(req.req_id))
                if prompt_logprobs
                else None
            )
            cache_blocks(req)
            if reason is not None:
                self._running.remove(req)
                self._finish(req, reason)
            if kept == 1:  # the usual case: one token, the request's newest
                outputs.append(
                    EngineCoreOutput(
                        req.req_id,
                        tokens[0],
                        logprobs,
                        reason,
                        req.num_cached_tokens,
                        len(req.output_token_ids),
                        req.num_preemptions,
                    )
                )
                continue
            first_output = req.num_output_tokens - kept
            for j, token in enumerate(tokens[:kept]):
                last = j == kept - 1
                outputs.append(
                    EngineCoreOutput(
                        req_id=req.req_id,
                        new_token=token,
                        prompt_logprobs=logprobs if j == 0 else None,
                        finish_reason=reason if last else None,
                        num_cached_tokens=req.num_cached_tokens,
                        num_output_tokens=first_output + j + 1,
                        num_preemptions=req.num_preemptions,
                    )
                )
            if not kept and (logprobs is not None or reason is not None):
                outputs.append(
                    EngineCoreOutput(
                        req_id=req.req_id,
                        new_token=None,
                        prompt_logprobs=logprobs,
                        finish_reason=reason,
                        num_cached_tokens=req.num_cached_tokens,
                        num_output_tokens=req.num_output_tokens,
                        num_preemptions=req.num_preemptions,
                    )
                )
        return outputs

    def _new_prompt_logprobs(
        self, req: Request, logprobs: PromptLogprobs | None
    ) -> PromptLogprobs | None:
        """Drop positions already delivered (a recomputation produces them again)."""
        if logprobs is None:
            return None
        first_new = self._next_prompt_logprob_pos[req.req_id]
        end = logprobs.first_pos + len(logprobs.logprobs)
        if end <= first_new:
            return None
        self._next_prompt_logprob_pos[req.req_id] = end
        if logprobs.first_pos >= first_new:
            return logprobs
        skip = first_new - logprobs.first_pos
        return PromptLogprobs(req.req_id, first_new, logprobs.logprobs[skip:])


def check_request(req: Request, max_tokens_per_request: int) -> None:
    """:meth:`Scheduler.check_request` for a front end that holds only the KV capacity (the
    gRPC process of --engine-process, whose scheduler lives in the engine process)."""
    if not req.prompt_token_ids:
        raise ValueError(f"request {req.req_id!r} has an empty prompt")
    if req.stopping.max_new_tokens < 1:
        raise ValueError(f"request {req.req_id!r}: max_new_tokens must be at least 1")
    total = req.num_prompt_tokens + req.stopping.max_new_tokens
    if total > max_tokens_per_request:
        raise ValueError(
            f"request {req.req_id!r} needs up to {total} tokens of KV cache "
            f"(prompt {req.num_prompt_tokens} + max_new_tokens "
            f"{req.stopping.max_new_tokens}) but the cache holds "
            f"{max_tokens_per_request}"
        )
    if req.status is not RequestStatus.WAITING or req.num_computed_tokens or req.output_token_ids:
        raise ValueError(f"request {req.req_id!r} is not fresh")
