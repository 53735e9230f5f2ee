"""Benchmark statistics: percentiles and run summaries."""

from __future__ import annotations

import math

import numpy as np
import pytest

from genserve.bench.records import RequestRecord, RunResult
from genserve.bench.stats import percentile, summarise


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [0.3, 5.0, 1.2, 9.9, 2.2, 2.2, 7.1]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([4.0], 99) == 4.0
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _record(prompt_id: int, start: float, first: float, gap: float, num: int) -> RequestRecord:
    times = tuple(first + i * gap for i in range(num))
    return RequestRecord(
        prompt_id=prompt_id,
        start=start,
        end=times[-1] + 0.001,
        token_times=times,
        num_generated_tokens=num,
        max_new_tokens=num,
        input_length=40,
        finish_reason="length",
        cached_tokens=16,
    )


def test_record_derived_timings() -> None:
    record = _record(0, start=10.0, first=10.2, gap=0.05, num=5)
    assert record.ttft == pytest.approx(0.2)
    assert record.inter_token_latencies == pytest.approx([0.05] * 4)
    assert record.decode_rate == pytest.approx(20.0)
    assert record.e2e == pytest.approx(0.401)


def test_summary_counts_tokens_and_latencies() -> None:
    records = (
        _record(0, start=0.0, first=0.1, gap=0.01, num=11),  # ends at 0.201
        _record(1, start=0.0, first=0.3, gap=0.02, num=6),  # ends at 0.401
        RequestRecord(1, 0.0, 0.05, (), 0, 6, 0, error="UNAVAILABLE: draining"),
    )
    summary = summarise(RunResult("genserve_c2", "genserve", 2, records, wall_s=0.5))
    assert summary["num_requests"] == 3 and summary["num_failed"] == 1
    assert summary["errors"] == ["UNAVAILABLE: draining"]
    assert summary["num_generated_tokens"] == 17
    assert summary["throughput_tok_s"] == pytest.approx(34.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(10.0)  # 10 gaps of 10 ms, 5 of 20 ms
    assert summary["itl_ms"]["p99"] == pytest.approx(20.0)
    assert summary["decode_tok_s_per_stream"] == pytest.approx(75.0)  # median of 100 and 50
    assert summary["cached_tokens"] == 32
    assert summary["finish_reasons"] == {"length": 2}
    assert summary["num_steady"] == 0  # both started in the opening burst


def test_steady_state_ttft_only_counts_requests_joining_a_running_batch() -> None:
    records = (
        _record(0, start=0.0, first=0.5, gap=0.01, num=11),  # burst; ends at 0.601
        _record(1, start=0.0, first=0.6, gap=0.01, num=11),  # burst
        _record(2, start=0.61, first=0.66, gap=0.01, num=3),  # joined: TTFT 50 ms
    )
    summary = summarise(RunResult("genserve_c2", "genserve", 2, records, wall_s=1.0))
    assert summary["num_steady"] == 1
    assert summary["ttft_steady_ms"]["p50"] == pytest.approx(50.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(500.0)


def test_steady_window_sets_throughput_and_joining_ttft() -> None:
    # Two staggered streams: the window opens when the second stream's first request
    # starts (0.2) and closes when the first stream runs out of work (1.0).
    records = (
        _record(0, start=0.0, first=0.05, gap=0.1, num=5),  # tokens 0.05 .. 0.45
        _record(1, start=0.2, first=0.3, gap=0.1, num=5),  # tokens 0.3 .. 0.7, TTFT 100 ms
        _record(2, start=0.46, first=0.5, gap=0.1, num=5),  # tokens 0.5 .. 0.9, TTFT 40 ms
    )
    run = RunResult("genserve_c2", "genserve", 2, records, wall_s=1.0, steady_window=(0.2, 1.0))
    summary = summarise(run)
    # Tokens inside [0.2, 1.0]: 3 of request 0, 5 of request 1, 5 of request 2.
    assert summary["throughput_tok_s"] == pytest.approx(13 / 0.8)
    assert summary["throughput_wall_tok_s"] == pytest.approx(15.0)
    assert summary["steady_s"] == pytest.approx(0.8)
    assert summary["num_steady"] == 2  # requests 1 and 2 started inside the window
    assert summary["ttft_steady_ms"]["p50"] == pytest.approx(70.0)
