"""Test double for the model runner, used by the scheduler tests (no torch).

:class:`PagedFakeRunner` keeps a real paged "KV cache": for each computed position it writes
into the block slot a value that, like real KV, depends on the whole prefix up to that
position (a rolling hash).  When it samples, it reads the entire sequence back through the
block table and checks it against its own record of the request; so a wrong block table, a
bad prefix-cache hit, a shared block overwritten by another request or a lost position fails
loudly.  The sampled token is a deterministic function of the sequence, as greedy decoding is.

Speculative chunks are verified as a model would: the draft positions are written (with the
values of the drafted sequence, which stay behind as garbage when a draft is rejected), the
token after every position is "sampled", and drafts are accepted while they match.  With
``repetitive=True`` the next token depends only on the last two tokens, so sequences fall
into cycles and n-gram drafts are often, but not always, accepted.
"""

from __future__ import annotations

import dataclasses
import hashlib

from genserve.engine.request import FinishReason, Request, StoppingCriteria
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.step import (
    PromptLogprobs,
    RunnerOutput,
    SampledToken,
    SamplingParams,
    SchedulerOutput,
    TokenLogprob,
)

VOCAB_SIZE = 50


def roll(prev: int, token_id: int) -> int:
    """The fake 'KV' of a position: depends on every token up to it."""
    digest = hashlib.blake2b(f"{prev}:{token_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def next_token(rolled: int) -> int:
    return rolled % VOCAB_SIZE


def repetitive_next_token(seq: list[int]) -> int:
    """A "model" whose output depends on the last two tokens only: it loops."""
    prev = seq[-2] if len(seq) > 1 else 0
    return (prev * 3 + seq[-1] * 5 + 1) % 7 + 1


def sample_next(rolled_last: int, seq: list[int], repetitive: bool) -> int:
    return repetitive_next_token(seq) if repetitive else next_token(rolled_last)


class PagedFakeRunner:
    """Implements the Runner protocol; raises AssertionError on any contract violation.

    A chunk with ``token_from_last_step`` (overlapped scheduling) has its placeholder
    replaced by the token this runner sampled for the request in the step before, which
    must be the last of its record."""

    supports_token_from_last_step = True

    def __init__(self, num_blocks: int, block_size: int, repetitive: bool = False) -> None:
        self.block_size = block_size
        self.repetitive = repetitive
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.slots: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.seqs: dict[str, list[int]] = {}  # the runner's record of each request's tokens
        self.rolled: dict[str, list[int]] = {}  # rolling KV values of the known tokens
        self.num_prompt: dict[str, int] = {}
        self.want_prompt_logprobs: dict[str, bool] = {}
        self.num_steps = 0
        self.num_tokens = 0
        self.num_filled = 0  # placeholders filled from the previous step
        self._last_sampled: set[str] = set()  # requests sampled in the previous step

    def _rolled_upto(self, req_id: str, end: int) -> list[int]:
        seq, rolled = self.seqs[req_id], self.rolled[req_id]
        while len(rolled) < end:
            prev = rolled[-1] if rolled else 0
            rolled.append(roll(prev, seq[len(rolled)]))
        return rolled

    def execute_model(self, step: SchedulerOutput) -> RunnerOutput:
        assert step.chunks, "an empty step reached the runner"
        self.num_steps += 1
        self.num_tokens += step.num_tokens
        for req_id in step.finished_req_ids:
            assert req_id in self.seqs, f"finished {req_id} unknown to the runner"
            del self.seqs[req_id], self.rolled[req_id]
            del self.num_prompt[req_id], self.want_prompt_logprobs[req_id]
        for new in step.new_requests:
            assert new.req_id not in self.seqs, f"{new.req_id} registered twice"
            assert len(new.all_token_ids) == new.num_prompt_tokens + new.num_output_tokens
            self.seqs[new.req_id] = list(new.all_token_ids)
            self.rolled[new.req_id] = []
            self.num_prompt[new.req_id] = new.num_prompt_tokens
            self.want_prompt_logprobs[new.req_id] = new.sampling.prompt_logprobs
        step = self._fill_placeholders(step)
        bs = self.block_size
        seen: set[str] = set()
        # Write every chunk's KV first, then read: as a forward pass does, layer by layer.
        drafted: dict[str, list[int]] = {}  # "KV" of each chunk's draft positions
        for chunk in step.chunks:
            assert chunk.req_id not in seen, f"{chunk.req_id} twice in one step"
            seen.add(chunk.req_id)
            seq = self.seqs[chunk.req_id]
            num_drafts = chunk.num_draft_tokens
            end = chunk.start_pos + len(chunk.token_ids) - num_drafts  # known tokens only
            assert (
                list(chunk.token_ids[: len(chunk.token_ids) - num_drafts])
                == seq[chunk.start_pos : end]
            )
            assert chunk.sample == (end == len(seq))
            assert not num_drafts or (chunk.sample and end == chunk.start_pos + 1)
            assert len(chunk.block_ids) * bs >= end + num_drafts, "block table too short"
            rolled = self._rolled_upto(chunk.req_id, end)
            for pos in range(chunk.start_pos, end):
                self.slots[chunk.block_ids[pos // bs]][pos % bs] = rolled[pos]
            draft_kv = drafted[chunk.req_id] = []
            for j, token_id in enumerate(chunk.token_ids[len(chunk.token_ids) - num_drafts :]):
                pos = end + j
                draft_kv.append(roll(draft_kv[-1] if draft_kv else rolled[end - 1], token_id))
                self.slots[chunk.block_ids[pos // bs]][pos % bs] = draft_kv[-1]
        sampled: list[SampledToken] = []
        prompt_logprobs: list[PromptLogprobs] = []
        for chunk in step.chunks:
            num_drafts = chunk.num_draft_tokens
            end = chunk.start_pos + len(chunk.token_ids) - num_drafts
            rolled = self._rolled_upto(chunk.req_id, end)
            kv = [self.slots[chunk.block_ids[p // bs]][p % bs] for p in range(end + num_drafts)]
            assert kv == rolled[:end] + drafted[chunk.req_id], (
                f"{chunk.req_id}: KV read back wrong at step {step.step_id}"
            )
            num_prompt = self.num_prompt[chunk.req_id]
            if self.want_prompt_logprobs[chunk.req_id]:
                first, last = max(chunk.start_pos, 1), min(end, num_prompt)
                if first < last:
                    seq = self.seqs[chunk.req_id]
                    entries = tuple(TokenLogprob(seq[p], -float(p)) for p in range(first, last))
                    prompt_logprobs.append(PromptLogprobs(chunk.req_id, first, entries))
            if chunk.sample:
                seq = self.seqs[chunk.req_id]
                drafts = chunk.token_ids[len(chunk.token_ids) - num_drafts :]
                candidate = list(seq)  # the known sequence followed by the drafts
                kv_values = [rolled[end - 1], *drafted[chunk.req_id]]
                for j in range(num_drafts + 1):
                    token_id = sample_next(kv_values[j], candidate[: end + j], self.repetitive)
                    seq.append(token_id)
                    sampled.append(SampledToken(chunk.req_id, token_id, -1.0))
                    if j == num_drafts or token_id != drafts[j]:
                        break
                    candidate.append(drafts[j])
                    self.num_accepted_tokens += 1
                self.num_draft_tokens += num_drafts
        self._last_sampled = {t.req_id for t in sampled}
        return RunnerOutput(step.step_id, tuple(sampled), tuple(prompt_logprobs))

    def _fill_placeholders(self, step: SchedulerOutput) -> SchedulerOutput:
        if not any(c.token_from_last_step for c in step.chunks):
            return step
        chunks = []
        for c in step.chunks:
            if c.token_from_last_step:
                seq = self.seqs[c.req_id]
                assert c.req_id in self._last_sampled, f"{c.req_id}: no token sampled before"
                assert c.token_ids == (0,) and c.sample and c.start_pos == len(seq) - 1
                c = dataclasses.replace(c, token_ids=(seq[-1],), token_from_last_step=False)
                self.num_filled += 1
            chunks.append(c)
        return dataclasses.replace(step, chunks=tuple(chunks))

    def shutdown(self) -> None:
        self.seqs.clear()


def is_stop_token(token_id: int) -> bool:
    """Stands in for a stop string, which the engine detects after a token is returned."""
    return token_id == 7


def reference_output(
    prompt: list[int],
    max_new_tokens: int,
    eos_token_ids: frozenset[int],
    ignore_eos: bool,
    use_stop: bool,
    repetitive: bool = False,
) -> tuple[list[int], FinishReason]:
    """The tokens and finish reason a request gets with no memory pressure (and no
    speculation) at all."""
    rolled = 0
    for token_id in prompt:
        rolled = roll(rolled, token_id)
    out: list[int] = []
    while True:
        token_id = sample_next(rolled, prompt + out, repetitive)
        out.append(token_id)
        if len(out) >= max_new_tokens:
            return out, FinishReason.LENGTH
        if not ignore_eos and token_id in eos_token_ids:
            return out, FinishReason.EOS_TOKEN
        if use_stop and is_stop_token(token_id):
            return out, FinishReason.STOP_SEQUENCE
        rolled = roll(rolled, token_id)


class Harness:
    """Drives a Scheduler with a PagedFakeRunner the way the engine does, recording each
    request's tokens and its (single) end, and checking invariants after every step.

    With ``ahead`` it drives it as the overlapping engine does: the next step is scheduled
    (and run) before the results of the step in flight are applied, whenever the scheduler
    allows; otherwise right after they are applied."""

    def __init__(
        self, config: SchedulerConfig, repetitive: bool = False, ahead: bool = False
    ) -> None:
        self.sched = Scheduler(config)
        self.runner = PagedFakeRunner(config.num_blocks, config.block_size, repetitive)
        self.reqs: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.ends: dict[str, FinishReason] = {}
        self.use_stop: set[str] = set()
        self.steps: list[SchedulerOutput] = []
        self.prompt_logprob_pos: dict[str, list[int]] = {}
        self.ahead = ahead
        self.num_ahead = 0  # steps scheduled before the previous step's result
        self._in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_new_tokens: int = 8,
        *,
        eos_token_ids: frozenset[int] = frozenset(),
        ignore_eos: bool = False,
        use_stop: bool = False,
        cache_salt: str | None = None,
        prompt_logprobs: bool = False,
    ) -> Request:
        req = Request(
            req_id=req_id,
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(prompt_logprobs=prompt_logprobs),
            stopping=StoppingCriteria(max_new_tokens, eos_token_ids, ignore_eos),
            cache_salt=cache_salt,
        )
        self.sched.add_request(req)
        self.reqs[req_id] = req
        self.tokens[req_id] = []
        self.prompt_logprob_pos[req_id] = []
        if use_stop:
            self.use_stop.add(req_id)
        return req

    def _end(self, req_id: str, reason: FinishReason) -> None:
        assert req_id not in self.ends, f"{req_id} ended twice"
        self.ends[req_id] = reason

    def abort(self, req_id: str, reason: FinishReason = FinishReason.ABORTED) -> None:
        if req_id in self.reqs and req_id not in self.ends:
            self.sched.finish_requests([req_id], reason)
            self._end(req_id, reason)

    def step(self, abort_during: tuple[str, ...] = ()) -> SchedulerOutput:
        if self.ahead:
            return self._step_ahead(abort_during)
        out, result = self._schedule_and_run()
        self._apply(out, result, abort_during)
        return out

    def _step_ahead(self, abort_during: tuple[str, ...]) -> SchedulerOutput:
        """Apply the step in flight's result, after scheduling (and running) the next."""
        if self._in_flight is None:
            self._in_flight = self._schedule_and_run()
        out, result = self._in_flight
        following = None
        if self.sched.can_schedule_ahead(out):
            following = self._schedule_and_run()
            self.num_ahead += 1
        self._apply(out, result, abort_during)
        if following is None and self.sched.has_unfinished_requests():
            following = self._schedule_and_run()
        self._in_flight = following
        return out

    def _schedule_and_run(self) -> tuple[SchedulerOutput, RunnerOutput]:
        out = self.sched.schedule()
        self.steps.append(out)
        bs = self.sched.kv.block_size
        for chunk in out.chunks:
            # Blocks written this step belong to this request alone and are not in the
            # prefix cache: a shared or cached block is never written.
            end = chunk.start_pos + len(chunk.token_ids)
            for block_id in chunk.block_ids[chunk.start_pos // bs : (end - 1) // bs + 1]:
                block = self.sched.kv.pool.blocks[block_id]
                assert block.ref_cnt == 1 and block.block_hash is None, (chunk, block)
        if out.chunks:
            result = self.runner.execute_model(out)
        else:
            assert not out.finished_req_ids and not out.new_requests
            result = RunnerOutput(out.step_id)
        return out, result

    def _apply(
        self, out: SchedulerOutput, result: RunnerOutput, abort_during: tuple[str, ...]
    ) -> None:
        if not out.chunks:
            return
        for req_id in abort_during:  # cancelled while the runner was busy
            self.abort(req_id)
        stopped_now: set[str] = set()
        for output in self.sched.update_from_output(out, result):
            if output.req_id in stopped_now:
                continue  # tokens after a stop string (several came from one chunk): dropped
            assert output.req_id not in self.ends, f"output for ended {output.req_id}"
            if output.prompt_logprobs is not None:
                plp = output.prompt_logprobs
                positions = range(plp.first_pos, plp.first_pos + len(plp.logprobs))
                self.prompt_logprob_pos[output.req_id].extend(positions)
            if output.new_token is not None:
                self.tokens[output.req_id].append(output.new_token.token_id)
                assert output.num_output_tokens == len(self.tokens[output.req_id])
            if output.finish_reason is not None:
                self._end(output.req_id, output.finish_reason)
            elif (
                output.req_id in self.use_stop
                and output.new_token is not None
                and is_stop_token(output.new_token.token_id)
            ):
                self.abort(output.req_id, FinishReason.STOP_SEQUENCE)
                stopped_now.add(output.req_id)
        self.sched.check_invariants()

    def run(self, max_steps: int = 10_000) -> int:
        """Step until every request ended; returns the number of steps."""
        for n in range(max_steps):
            if not self.sched.has_unfinished_requests() and self._in_flight is None:
                return n
            self.step()
        raise AssertionError("requests did not finish")

    def assert_all_blocks_free(self) -> None:
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
