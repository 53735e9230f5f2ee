"""``genserve-bench gguf-start`` (the 8B-shape start-up measurement of issue #28) on the same
path at a CI size: a Q4_K_M-mix GGUF written from random K-quant blocks
(``genserve.testing.kquant_gguf``'s small shape, ~45 MB), genserve started on it twice over
real gRPC, first with a fresh model cache and then with the cache the first start left.

The 8B shape itself (a 4.9 GB file, minutes of start-up and ~6 GB of memory on a 2-core
machine) is not a test: it runs as the bench, whose figures docs/benchmarks/cpu.md gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserve.bench.gguf_start import build_parser, run
from genserve.kernels import cpu as cpu_kernels

MiB = 1 << 20


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
async def test_small_q4_k_m_starts_twice_without_a_float_copy(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "--shape",
            "small-kquant-shape",
            "--out",
            str(tmp_path),
            "--servers",
            "genserve",
            "--max-total-tokens",
            "256",
            "--new-tokens",
            "4",
            "--startup-timeout",
            "300",
        ]
    )
    args.server_args = []
    record = await run(args)
    results = record["results"]
    assert isinstance(results, list) and [r["label"] for r in results] == [
        "first start",
        "second start",
    ]
    first, second = results
    size = int(record["bytes"])  # type: ignore[call-overload]
    # The cache keeps the config and tokenizer (a few MB), never a float copy (~6x the file).
    assert first["cache_added_mib"] < 16
    assert second["cache_added_mib"] == 0
    for start in results:
        assert start["kv_cache_mib"] > 0
        assert start["peak_rss_start_mib"] > size / MiB
        # VmHWM is the larger of the recorded peak and the current RSS, whose counters Linux
        # keeps in per-thread or per-CPU batches, so it reads approximately: a read after the
        # request once came out 0.1 MiB below the one before it (931.45 against 931.55, CI).
        assert start["peak_rss_after_request_mib"] >= start["peak_rss_start_mib"] - 2
    assert (tmp_path / "gguf_start.json").is_file()
