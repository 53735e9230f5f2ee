"""The cost of --engine-process's per-step message (issue #29), per side, at N rows.

Builds one decode step's delivery as the engine loop makes it (N rows, one token each, a
decode chunk per row with a 64-block table, the step's observation and scheduler stats),
then times, median of ``--repeats`` rounds of ``--iters`` each:

* ``engine_us`` — what the engine process spends: encode + pickle (``step_message``);
* ``front_us`` — what the gRPC process's reader thread spends: unpickle + decode;
* ``pipe_us`` — the bytes through a real ``multiprocessing`` pipe to another process and
  back (round trip / 2), the transport alone;
* ``bytes`` — the message size; ``naive_*`` — the same with the delivery and observation
  pickled as objects (what the compact rows save).

Usage: ``python -m genserve.bench.step_wire_cost [--rows 64 256] [--iters 200]``; prints
one JSON line per row count."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection

from genserve.engine import step_wire as wire
from genserve.engine.engine_loop import Delivery, StepObservation
from genserve.engine.outputs import TokenInfo, TokenOutput
from genserve.engine.scheduler_output import SchedulerStats
from genserve.step import ScheduledChunk, SchedulerOutput


def make_step(rows: int) -> tuple[Delivery, SchedulerStats]:
    chunks = tuple(
        ScheduledChunk(f"req-{i:04d}", (1000 + i,), 300 + i, tuple(range(64)), True)
        for i in range(rows)
    )
    step = SchedulerOutput(step_id=12345, chunks=chunks)
    outputs = [
        (f"req-{i:04d}", TokenOutput(100, TokenInfo(1000 + i, " word", -0.25, False)))
        for i in range(rows)
    ]
    observation = StepObservation(step, 0.025, 0, {}, 1234.5)
    stats = SchedulerStats(
        num_running=rows,
        num_waiting=0,
        num_used_blocks=rows * 20,
        num_total_blocks=100_000,
        kv_usage=0.1,
        num_preemptions=0,
        prefix_cache_queries=10,
        prefix_cache_hits=5,
        last_step_num_reqs=rows,
        last_step_num_tokens=rows,
        last_step_num_prefill_tokens=0,
        growth_reserve_ratio=0.0,
        spec_draft_tokens=0,
        spec_accepted_tokens=0,
    )
    return Delivery(outputs, observation), stats


def _median_us(fn: Callable[[], object], iters: int, repeats: int) -> float:
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - start) / iters)
    return statistics.median(rounds) * 1e6


def _echo(conn_in: Connection, conn_out: Connection) -> None:
    while True:
        data = conn_in.recv_bytes()
        if not data:
            return
        conn_out.send_bytes(data)


def _pipe_us(data: bytes, iters: int, repeats: int) -> float:
    ctx = multiprocessing.get_context("spawn")
    a_in, a_out = ctx.Pipe(duplex=False)
    b_in, b_out = ctx.Pipe(duplex=False)
    echo = ctx.Process(target=_echo, args=(a_in, b_out), daemon=True)
    echo.start()

    def round_trip() -> None:
        a_out.send_bytes(data)
        b_in.recv_bytes()

    round_trip()
    try:
        return _median_us(round_trip, iters, repeats) / 2
    finally:
        a_out.send_bytes(b"")
        echo.join(5)


def measure(rows: int, iters: int, repeats: int) -> dict[str, float]:
    delivery, stats = make_step(rows)
    data = wire.step_message(delivery, stats, 7)
    naive = pickle.dumps((wire.STEP, delivery, stats, 7), protocol=wire.PROTOCOL)

    def front() -> None:
        message = wire.loads(data)
        wire.decode_delivery(message[1])

    return {
        "rows": rows,
        "engine_us": round(
            _median_us(lambda: wire.step_message(delivery, stats, 7), iters, repeats), 1
        ),
        "front_us": round(_median_us(front, iters, repeats), 1),
        "pipe_us": round(_pipe_us(data, iters, repeats), 1),
        "bytes": len(data),
        "naive_engine_us": round(
            _median_us(
                lambda: pickle.dumps((wire.STEP, delivery, stats, 7), protocol=wire.PROTOCOL),
                iters,
                repeats,
            ),
            1,
        ),
        "naive_front_us": round(_median_us(lambda: pickle.loads(naive), iters, repeats), 1),
        "naive_bytes": len(naive),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m genserve.bench.step_wire_cost")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    for rows in args.rows:
        print(json.dumps(measure(rows, args.iters, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
