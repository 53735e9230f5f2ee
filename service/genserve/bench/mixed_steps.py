"""How many of a closed-loop run's steps carry prompt tokens (issue #29), and what they cost.

Drives the real :class:`~genserve.engine.scheduler.Scheduler` (the one the server builds, with
its admission policy) through a closed-loop load like ``genserve.bench.grpc_load``'s: ``S``
streams, each sending its next request as soon as the last one ends, their first requests
spread over one answer's length (the bench's ramp); ~40-token prompts, ``N`` new tokens, no
EOS.  The "runner" is a fake that samples a fixed token, so nothing but the scheduler's own
decisions is measured: no torch, no model.

Per run it reports the fraction of *mixed* steps (steps that carry prompt tokens: on CUDA
those run eagerly, without a CUDA graph), their prompt tokens and admitted requests, the mean
decode rows per step, and each request's time to first token in steps.  A step-cost model
turns the counts into time: a decode step (graph replay) costs ``graph_ms + row_ms * rows``,
a mixed step additionally ``eager_ms`` (the launches of an eager forward) and
``prefill_us`` per prompt token; the model's defaults are the H200 figures of
docs/gpu-step.md and are an estimate, not a measurement.

Usage: ``python -m genserve.bench.mixed_steps --streams 64 256 [--batching auto on off]``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
from dataclasses import dataclass

from genserve.engine.request import Request, StoppingCriteria
from genserve.engine.scheduler import Scheduler
from genserve.engine.scheduler_config import SchedulerConfig
from genserve.step import RunnerOutput, SampledToken, SamplingParams, SchedulerOutput

BLOCK_SIZE = 16
TOKEN = 7  # what the fake runner samples; never an end-of-sequence id (none is set)


@dataclass(frozen=True, slots=True)
class StepCost:
    """The step-cost model (milliseconds; see the module docstring)."""

    graph_ms: float = 4.7  # H200, 8B bf16, one-row decode step replayed from its graph
    row_ms: float = 0.0125  # (5.5 ms at 64 rows - 4.7) / 63
    eager_ms: float = 10.0  # an eager forward's launches over a graph replay (estimate)
    prefill_us: float = 3.0  # device time per prompt token (8B: ~16 GFLOP a token)
    rtt_ms: float = 1.0  # a stream's next request arrives this long after its last one ends

    def step_ms(self, rows: int, prompt_tokens: int) -> float:
        ms = self.graph_ms + self.row_ms * rows
        if prompt_tokens:
            ms += self.eager_ms + prompt_tokens * self.prefill_us / 1000
        return ms


_DEFAULT = StepCost()


@dataclass(frozen=True, slots=True)
class LoadShape:
    """The closed-loop load."""

    streams: int
    new_tokens: int = 128
    prompt_tokens: tuple[int, int] = (35, 45)  # lengths cycle through this range
    requests: int = 0  # 0: 12 answers per stream
    max_batch_prefill_tokens: int = 4096 + 50  # the CUDA default: max input + 50


def simulate(
    load: LoadShape,
    batch_arrivals: bool,
    cost: StepCost,
    waiting_served_ratio: float = 1.2,
    max_waiting_tokens: int = 20,
) -> dict[str, float | int | bool]:
    """Run the load to completion; return the counts and the modelled speed."""
    streams = load.streams
    total = load.requests or 12 * streams
    tokens_per_block = -(-(load.prompt_tokens[1] + load.new_tokens) // BLOCK_SIZE) + 1
    config = SchedulerConfig(
        num_blocks=streams * tokens_per_block + 16,
        block_size=BLOCK_SIZE,
        max_batch_prefill_tokens=load.max_batch_prefill_tokens,
        max_num_running=streams,
        waiting_served_ratio=waiting_served_ratio,
        max_waiting_tokens=max_waiting_tokens,
        batch_arrivals=batch_arrivals,
    )
    sched = Scheduler(config)
    lo, hi = load.prompt_tokens
    sent = 0
    # The bench's ramp: stream k's first request after stream 0 produced k * N / S tokens.
    ramp = [(k * load.new_tokens // streams, k) for k in range(streams)]
    arrivals: list[tuple[float, int]] = []  # (time in ms, stream) of later requests
    arrived_at: dict[str, float] = {}
    ttft_ms: list[float] = []
    ttft_steps: list[int] = []
    arrived_step: dict[str, int] = {}
    now = 0.0
    steps = mixed = prompt_total = admitted_total = rows_total = output_tokens = 0
    st_steps = st_mixed = st_rows = st_out = 0
    st_ms = 0.0
    mixed_prompt: list[int] = []
    mixed_admitted: list[int] = []

    def send(stream: int) -> None:
        nonlocal sent
        rid = f"s{stream}-{sent}"
        length = lo + sent % (hi - lo + 1)
        prompt = [1000 + (sent * 131 + j * 17) % 30000 for j in range(length)]
        sent += 1
        req = Request(rid, prompt, SamplingParams(), StoppingCriteria(load.new_tokens))
        sched.add_request(req)
        arrived_at[rid] = now
        arrived_step[rid] = steps

    while sent < total or sched.has_unfinished_requests():
        while ramp and ramp[0][0] <= steps and sent < total:
            send(heapq.heappop(ramp)[1])
        while arrivals and arrivals[0][0] <= now and sent < total:
            send(heapq.heappop(arrivals)[1])
        step: SchedulerOutput = sched.schedule()
        if not step.chunks:
            # Nothing runnable (batching holds arrivals back only while a batch runs, so this
            # is an empty engine): wait for the next arrival.
            if arrivals and sent < total:
                now = max(now, arrivals[0][0])
            elif ramp:
                steps = ramp[0][0]
            else:
                break
            continue
        new_ids = {n.req_id for n in step.new_requests}
        # Prompt chunks (a whole prompt or a part of one) against decode rows.
        prompt = sum(len(c.token_ids) for c in step.chunks if len(c.token_ids) > 1)
        rows = sum(1 for c in step.chunks if len(c.token_ids) == 1)
        step_ms = cost.step_ms(rows, prompt)
        now += step_ms
        steps += 1
        # The steady state: every stream started (the ramp took one answer's length) and
        # none has run out of requests yet.
        steady = steps > load.new_tokens and sent < total
        if steady:
            st_steps += 1
            st_mixed += prompt > 0
            st_rows += rows
            st_ms += step_ms
            st_out += sum(1 for c in step.chunks if c.sample)
        rows_total += rows
        if prompt:
            mixed += 1
            prompt_total += prompt
            mixed_prompt.append(prompt)
            mixed_admitted.append(len(new_ids))
        admitted_total += len(new_ids)
        sampled = tuple(SampledToken(c.req_id, TOKEN, 0.0) for c in step.chunks if c.sample)
        for out in sched.update_from_output(step, RunnerOutput(step.step_id, sampled)):
            rid = out.req_id
            if out.new_token is not None and out.num_output_tokens == 1:
                ttft_ms.append(now - arrived_at[rid])
                ttft_steps.append(steps - arrived_step[rid])
            if out.new_token is not None:
                output_tokens += 1
            if out.finish_reason is not None:
                stream = int(rid[1:].split("-")[0])
                heapq.heappush(arrivals, (now + cost.rtt_ms, stream))
    return {
        "streams": streams,
        "batch_arrivals": batch_arrivals,
        "steps": steps,
        "mixed_steps": mixed,
        "mixed_fraction": round(mixed / steps, 4),
        "prompt_tokens_per_mixed_step": round(prompt_total / max(mixed, 1), 1),
        "max_prompt_tokens_in_a_step": max(mixed_prompt, default=0),
        "admitted_per_mixed_step": round(statistics.fmean(mixed_admitted or [0]), 2),
        "decode_rows_per_step": round(rows_total / steps, 1),
        "ttft_steps_p50": statistics.median(ttft_steps),
        "ttft_ms_p50": round(statistics.median(ttft_ms), 1),
        "ttft_ms_p90": round(statistics.quantiles(ttft_ms, n=10)[-1], 1),
        "model_tok_per_s": round(1000 * output_tokens / now, 1),
        "model_step_ms": round(now / steps, 2),
        "steady_steps": st_steps,
        "steady_mixed_fraction": round(st_mixed / max(st_steps, 1), 4),
        "steady_decode_rows_per_step": round(st_rows / max(st_steps, 1), 1),
        "steady_model_tok_per_s": round(1000 * st_out / max(st_ms, 1e-9), 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batching", nargs="+", choices=("on", "off"), default=["on", "off"])
    parser.add_argument("--max-waiting-tokens", type=int, nargs="+", default=[20])
    parser.add_argument("--waiting-served-ratio", type=float, default=1.2)
    parser.add_argument("--eager-ms", type=float, default=_DEFAULT.eager_ms)
    parser.add_argument("--graph-ms", type=float, default=_DEFAULT.graph_ms)
    parser.add_argument("--row-ms", type=float, default=_DEFAULT.row_ms)
    args = parser.parse_args(argv)
    cost = StepCost(graph_ms=args.graph_ms, row_ms=args.row_ms, eager_ms=args.eager_ms)
    for streams in args.streams:
        for mode in args.batching:
            for wait in args.max_waiting_tokens if mode == "on" else [20]:
                row = simulate(
                    LoadShape(streams, args.new_tokens),
                    mode == "on",
                    cost,
                    args.waiting_served_ratio,
                    wait,
                )
                row["max_waiting_tokens"] = wait
                print(json.dumps(row))


if __name__ == "__main__":
    main()
