"""Summary statistics of a :class:`~genserve.bench.records.RunResult`.

Percentiles interpolate linearly between order statistics (numpy's default), so small samples
give stable, reproducible values.  Every latency is in milliseconds, throughput in generated
tokens per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from genserve.bench.records import RunResult


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``; NaN when empty."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values: Sequence[float], *qs: float) -> dict[str, float]:
    return {f"p{q:g}": percentile(values, q) * 1000.0 for q in qs}


def _steady_throughput(run: RunResult) -> float | None:
    """Generated tokens per second inside the run's steady window, or None without one."""
    if run.steady_window is None:
        return None
    low, high = run.steady_window
    tokens = sum(low <= t <= high for r in run.records if r.ok for t in r.token_times)
    return tokens / (high - low)


def summarise(run: RunResult) -> dict[str, Any]:
    """Throughput and latency figures of one run, as a JSON-ready dict.

    ``throughput_tok_s`` counts generated tokens of successful requests per second: inside
    the steady window when the run has one (staggered genserve levels: all streams busy, no
    ramp-up or tail), else over ``wall_s`` (``throughput_wall_tok_s`` is always the latter).
    ``decode_tok_s_per_stream`` is the median per-request rate after the first token (what
    one user sees while tokens stream).  ``ttft_steady_ms`` only counts requests that joined
    a running batch: submitted inside the steady window (or, without one, after the run's
    first request ended); ``num_steady`` of them.  Failed requests are counted, not timed.
    """
    ok = [r for r in run.records if r.ok]
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    low, high = run.steady_window or (math.nan, math.nan)
    if run.steady_window is not None:
        joined = [r for r in ok if low <= r.start <= high]
    else:
        first_end = min((r.end for r in ok), default=math.inf)
        joined = [r for r in ok if r.start >= first_end]
    steady_ttfts = [t for r in joined if (t := r.ttft) is not None]
    itls = [gap for r in ok for gap in r.inter_token_latencies]
    decode_rates = [d for r in ok if (d := r.decode_rate) is not None]
    num_tokens = sum(r.num_generated_tokens for r in ok)
    finish_reasons: dict[str, int] = {}
    for record in ok:
        finish_reasons[record.finish_reason] = finish_reasons.get(record.finish_reason, 0) + 1
    wall_throughput = num_tokens / run.wall_s if run.wall_s > 0 else math.nan
    steady_throughput = _steady_throughput(run)
    return {
        "name": run.name,
        "system": run.system,
        "concurrency": run.concurrency,
        "num_requests": len(run.records),
        "num_failed": len(run.records) - len(ok),
        "errors": sorted({r.error for r in run.records if r.error is not None}),
        "num_generated_tokens": num_tokens,
        "mean_generated_tokens": num_tokens / len(ok) if ok else math.nan,
        "mean_input_length": sum(r.input_length for r in ok) / len(ok) if ok else math.nan,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "finish_reasons": finish_reasons,
        "wall_s": run.wall_s,
        "steady_s": None if run.steady_window is None else high - low,
        "throughput_tok_s": wall_throughput if steady_throughput is None else steady_throughput,
        "throughput_wall_tok_s": wall_throughput,
        "decode_tok_s_per_stream": percentile(decode_rates, 50),
        "ttft_ms": _ms(ttfts, 50, 90, 99),
        "num_steady": len(steady_ttfts),
        "ttft_steady_ms": _ms(steady_ttfts, 50, 90, 99),
        "itl_ms": _ms(itls, 50, 99),
        "e2e_ms": _ms([r.e2e for r in ok], 50, 90, 99),
        "notes": list(run.notes),
    }
