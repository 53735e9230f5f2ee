"""genserve-bench --client-processes: a load level split over processes, merged back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from genserve.bench.cli import main
from genserve.bench.load_processes import merge, split
from genserve.bench.records import RequestRecord, RunResult
from tests.utils.live_server import free_port


def _record(prompt_id: int, start: float, end: float) -> RequestRecord:
    return RequestRecord(
        prompt_id=prompt_id,
        start=start,
        end=end,
        token_times=(start + 0.1, end),
        num_generated_tokens=2,
        max_new_tokens=2,
        input_length=5,
        finish_reason="length",
    )


def test_split_is_even_and_complete() -> None:
    assert split(10, 3) == [4, 3, 3]
    assert split(2, 2) == [1, 1]
    assert sum(split(257, 4)) == 257


def test_merge_unites_records_and_intersects_steady_windows() -> None:
    a = RunResult("x", "genserve", 2, (_record(0, 1.0, 3.0),), 2.0, (), (1.5, 2.8))
    b = RunResult("x", "genserve", 2, (_record(1, 2.0, 5.0),), 3.0, ("slow",), (2.0, 4.0))
    merged = merge([a, b], "", 4)
    assert merged.name == "genserve_c4" and merged.concurrency == 4
    assert [r.prompt_id for r in merged.records] == [0, 1]
    assert merged.wall_s == pytest.approx(4.0)
    assert merged.steady_window == (2.0, 2.8)
    assert "client process 1: slow" in merged.notes
    no_window = RunResult("x", "genserve", 1, (_record(2, 0.0, 1.0),), 1.0)
    assert merge([a, no_window], "n", 3).steady_window is None


@pytest.mark.timeout(300)
def test_bench_level_over_two_client_processes(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("llama")
    out = tmp_path / "bench"
    exit_code = main(
        [
            *("--address", f"127.0.0.1:{free_port()}"),
            *("--concurrency", "2", "--num-prompts", "6", "--max-new-tokens", "5"),
            *("--prompt-len-mean", "16", "--warmup-requests", "0", "--client-processes", "2"),
            *("--out", str(out), "--no-progress", "--launch", "--"),
            *("--model-id", str(model_dir), "--dtype", "float32"),
            *("--max-batch-total-tokens", "4096", "--max-total-tokens", "512"),
        ]
    )
    log = (out / "server.log").read_text() if (out / "server.log").exists() else ""
    assert exit_code == 0, log[-3000:]
    results = json.loads((out / "results.json").read_text())
    (level,) = results["genserve"]
    assert level["concurrency"] == 2
    assert level["num_requests"] == 6 and level["num_failed"] == 0
    assert level["throughput_tok_s"] > 0
    rows = results["requests"]["genserve_c2"]
    # Each process took every other prompt: together they sent all six.
    assert sorted(row["prompt_id"] for row in rows) == list(range(6))
