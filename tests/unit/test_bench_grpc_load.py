"""genserve-bench end to end: it launches a real genserve (tiny random model) as a
subprocess, loads it over gRPC, runs the prefix scenario and the HF baselines, and writes
its report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from genserve.bench.cli import main
from tests.utils.live_server import free_port


@pytest.mark.timeout(300)
def test_bench_launches_loads_and_reports(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama")
    out = tmp_path / "bench"
    exit_code = main(
        [
            *("--address", f"127.0.0.1:{free_port()}"),
            *("--concurrency", "1,3", "--num-prompts", "4", "--max-new-tokens", "6"),
            *("--prompt-len-mean", "20", "--warmup-requests", "1", "--scenario", "all"),
            *("--prefix-requests", "2", "--prefix-tokens", "64", "--prefix-max-new-tokens", "2"),
            *("--hf-baseline", "--model-id", str(model_dir), "--dtype", "float32"),
            *("--hf-batch-sizes", "1,3", "--hf-min-prompts", "2", "--threads", "1"),
            *("--out", str(out), "--no-progress", "--launch", "--"),
            *("--model-id", str(model_dir), "--dtype", "float32"),
            *("--max-batch-total-tokens", "4096", "--max-total-tokens", "512"),
        ]
    )
    log = (out / "server.log").read_text() if (out / "server.log").exists() else ""
    assert exit_code == 0, log[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    assert results["server_info"]["model_dtype"] == "float32"

    levels = {s["concurrency"]: s for s in results["genserve"]}
    assert sorted(levels) == [1, 3]
    for summary in levels.values():
        assert summary["num_requests"] == max(4, 3 * summary["concurrency"])
        assert summary["num_failed"] == 0
        assert 0 < summary["mean_generated_tokens"] <= 6
        assert summary["throughput_tok_s"] > 0 and summary["ttft_ms"]["p50"] > 0
    # Staggered streams: at 3 streams there is a window with all of them busy, and requests
    # that joined the running batch inside it.
    assert levels[3]["steady_s"] > 0 and levels[3]["num_steady"] > 0
    assert levels[1]["steady_s"] is None
    for row in results["requests"]["genserve_c3"]:
        # The server's own prompt length is recorded; prompts were fitted to their drawn length.
        assert row["input_length"] > 8 and row["error"] is None
        assert row["finish_reason"] in ("length", "eos_token")

    prefix = results["prefix"]
    assert prefix["cold_cached_tokens"] == 0  # salted system prompts: nothing to reuse
    assert prefix["warm_cached_tokens"] >= 2 * 48  # the shared 64-token prompt's full blocks

    baselines = {b["name"]: b for b in results["baselines"]}
    assert {"hf_generate_b1", "hf_generate_b3"} <= set(baselines)
    assert baselines["hf_generate_b1"]["num_requests"] == 2
    assert baselines["hf_generate_b3"]["num_requests"] == 3
    assert any(r["baseline"] == "hf_generate_b3" for r in results["ratios"])
    assert {t["target"] for t in results["targets"]} >= {"failed requests"}
