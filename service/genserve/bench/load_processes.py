"""One load level split over several client processes (``genserve-bench --client-processes``).

One Python process receiving every streamed message spends ~70 µs of CPU per message
(measured with ``genserve.bench.stream_host``): near 12-14k messages/s it saturates a core
and the benchmark measures itself, not the server (a GPU at 256 streams streams 8-12k
tokens/s).  Here the level's streams and requests are split evenly over ``processes``
spawned processes, each running :func:`~genserve.bench.grpc_load.run_level` on channels of
its own; their records are merged into one :class:`RunResult`.

Merging: ``time.perf_counter`` is CLOCK_MONOTONIC on Linux, one clock for every process, so
record times compare across processes; the wall span is the union of the records' spans and
the steady window the intersection of the processes' own windows (every stream of every
process in flight).  Each process staggers its own streams; the processes start together."""

from __future__ import annotations

import asyncio
import math
import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor

import grpc

from genserve.bench.grpc_load import run_level
from genserve.bench.prompts import Prompt
from genserve.bench.records import RequestRecord, RunResult

# Streams per HTTP/2 connection (servers commonly cap concurrent streams at 100): the
# in-process load and each client process open one channel per this many streams.
STREAMS_PER_CHANNEL = 64


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal non-negative shares, larger ones first."""
    return [total // parts + (k < total % parts) for k in range(parts)]


def _process_level(
    address: str,
    prompts: Sequence[Prompt],
    concurrency: int,
    num_requests: int,
    max_duration_s: float,
    request_timeout_s: float,
    stagger: bool,
) -> RunResult:
    async def level() -> RunResult:
        count = max(1, math.ceil(concurrency / STREAMS_PER_CHANNEL))
        channels = [grpc.aio.insecure_channel(address) for _ in range(count)]
        try:
            return await run_level(
                channels,
                prompts,
                concurrency=concurrency,
                num_requests=num_requests,
                max_duration_s=max_duration_s,
                request_timeout_s=request_timeout_s,
                stagger=stagger,
            )
        finally:
            for channel in channels:
                await channel.close()

    return asyncio.run(level())


def merge(results: Sequence[RunResult], name: str, concurrency: int) -> RunResult:
    """One level's result from its processes' results (see the module docstring)."""
    records: tuple[RequestRecord, ...] = tuple(r for res in results for r in res.records)
    wall = max(r.end for r in records) - min(r.start for r in records)
    windows = [res.steady_window for res in results]
    steady: tuple[float, float] | None = None
    if windows and all(w is not None for w in windows):
        start = max(w[0] for w in windows if w is not None)
        end = min(w[1] for w in windows if w is not None)
        steady = (start, end) if end > start else None
    notes = tuple(f"client process {k}: {n}" for k, res in enumerate(results) for n in res.notes)
    notes += (f"load split over {len(results)} client processes",)
    return RunResult(
        name=name or f"genserve_c{concurrency}",
        system="genserve",
        concurrency=concurrency,
        records=records,
        wall_s=wall,
        notes=notes,
        steady_window=steady,
    )


async def run_level_processes(
    address: str,
    prompts: Sequence[Prompt],
    concurrency: int,
    num_requests: int,
    max_duration_s: float,
    request_timeout_s: float,
    processes: int,
    name: str = "",
    on_done: Callable[[RequestRecord], None] | None = None,
    stagger: bool = True,
) -> RunResult:
    """:func:`run_level` with its streams and requests split over ``processes`` processes
    (fewer when there are fewer streams).  Each process takes every ``processes``-th prompt,
    so together they send the same prompts.  ``on_done`` runs for every record once all
    processes have finished."""
    if processes < 1:
        raise ValueError("processes must be at least 1")
    parts = min(processes, concurrency, num_requests)
    streams, requests = split(concurrency, parts), split(num_requests, parts)
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(parts, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            loop.run_in_executor(
                pool,
                _process_level,
                address,
                list(prompts[k::parts]) or list(prompts),
                streams[k],
                requests[k],
                max_duration_s,
                request_timeout_s,
                stagger,
            )
            for k in range(parts)
        ]
        results = await asyncio.gather(*futures)
    merged = merge(results, name, concurrency)
    if on_done is not None:
        for record in merged.records:
            on_done(record)
    return merged
