"""CUDA-graph decode machinery that runs without a GPU: bucket lists, padding, and the
runner's routing of pure-decode steps through the static buffers (replayed eagerly on CPU,
so padding rows and the scratch block are checked against transformers)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from genserve.model.loader import ResolvedModel
from genserve.worker.cuda_graphs import (
    DecodeGraphs,
    default_batch_sizes,
    pad_decode_batch,
    parse_batch_sizes,
    pick_bucket,
)
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory
from tests.unit.test_model_runner import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    Driver,
    assert_matches_hf,
    random_prompts,
)


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("8,1,2,4,2") == (1, 2, 4, 8)
    assert parse_batch_sizes("0") == ()
    for bad in ("0,1", "-2", "a,b", ""):
        with pytest.raises(ValueError):
            parse_batch_sizes(bad)


def test_default_batch_sizes() -> None:
    assert default_batch_sizes(None) == (1, 2, 4, 8, *range(16, 257, 8))
    assert default_batch_sizes(20) == (1, 2, 4, 8, 16, 24)
    assert default_batch_sizes(3) == (1, 2, 4)
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(10_000)[-1] == 256


def test_pick_bucket() -> None:
    sizes = (1, 2, 4, 8, 16)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]
    assert pick_bucket(17, sizes) is None
    assert pick_bucket(0, sizes) is None


def test_pad_decode_batch_points_padding_at_the_scratch_block() -> None:
    padded = pad_decode_batch(
        token_ids=[7, 9],
        positions=[0, 21],  # row 1 sits in its second block, offset 5
        block_ids=[(3,), (5, 11, 12)],
        bucket=4,
        width=3,
        block_size=16,
        scratch_block=40,
    )
    assert padded is not None
    assert padded.num_rows == 2 and padded.bucket == 4
    assert padded.token_ids.tolist() == [7, 9, 0, 0]
    assert padded.positions.tolist() == [0, 21, 0, 0]
    assert padded.context_lens.tolist() == [1, 22, 1, 1]
    assert padded.slots.tolist() == [3 * 16, 11 * 16 + 5, 40 * 16, 40 * 16]
    # Only the columns the longest context covers (2 of the table's 3) travel to the device;
    # cells no context covers (never read) are the scratch block.
    np.testing.assert_array_equal(padded.block_table, [[3, 40], [5, 11], [40, 40], [40, 40]])


def test_pad_decode_batch_refuses_contexts_wider_than_the_table() -> None:
    assert pad_decode_batch([1], [48], [(1, 2, 3, 4)], 1, 3, 16, 9) is None
    with pytest.raises(ValueError):
        pad_decode_batch([1, 2], [0, 0], [(1,), (2,)], 1, 3, 16, 9)


def _runner_with_buffers(model_dir: Path, sizes: tuple[int, ...]) -> ModelRunner:
    """A CPU float32 runner whose pure-decode steps go through DecodeGraphs' static buffers
    (not captured: CPU), with one scratch block past the Driver's NUM_BLOCKS."""
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cpu")
    )
    runner.initialize_kv_cache(NUM_BLOCKS + 1, BLOCK_SIZE)
    runner.warmup()
    runner._graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        sizes,
        width=16,  # 256-token contexts
        block_size=BLOCK_SIZE,
        scratch_block=NUM_BLOCKS,
        device=torch.device("cpu"),
        use_triton_decode=False,
    )
    return runner


def test_padded_static_buffer_decodes_match_transformers(
    tiny_model_factory: TinyModelFactory,
) -> None:
    """Decode steps padded to a bucket (and mixed steps, and batches larger than every bucket,
    which run eagerly) give transformers' greedy tokens; padding writes only the scratch
    block, so no sequence's cache is disturbed."""
    model_dir = tiny_model_factory("llama")
    runner = _runner_with_buffers(model_dir, (1, 2, 4))
    graphs = runner._graphs
    assert graphs is not None
    driver = Driver(runner, budget=48)
    prompts = random_prompts([3, 17, 40, 95, 130, 1], seed=11)
    reqs = [driver.add(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    driver.run()
    for req in reqs:
        assert_matches_hf(model_dir, req, 10)
    assert graphs.num_runs > 0  # the static-buffer path served some steps
    assert sorted(driver.free) == list(range(NUM_BLOCKS))


def test_padded_decode_with_a_graph_then_shutdown_releases_it(
    tiny_model_factory: TinyModelFactory,
) -> None:
    """shutdown() drops the graphs (and with them their pool and the KV cache they hold)."""
    runner = _runner_with_buffers(tiny_model_factory("llama"), (1, 2))
    graphs = runner._graphs
    assert graphs is not None
    driver = Driver(runner, budget=48)
    driver.add("r0", random_prompts([5], seed=2)[0], 3)
    driver.run()
    assert graphs.num_runs > 0
    runner.shutdown()
    assert runner._graphs is None and runner.kv_caches == [] and runner.cuda_graph_sizes == ()
    assert graphs.kv_caches == [] and graphs.model is None


def test_graph_width_comes_from_the_total_token_limit() -> None:
    """A 131,072-position model served with the default limits gets a 4,096-token table
    (256 columns of 16), not 8,192 columns; an explicit --max-total-tokens is honoured."""
    from genserve.cli import _enable_cuda_graphs
    from genserve.config import load_config

    class Recorder:
        def enable_cuda_graphs(self, sizes: tuple[int, ...], max_seq_len: int, bs: int) -> None:
            self.max_seq_len = max_seq_len

    recorder = Recorder()
    _enable_cuda_graphs(load_config([], {}), recorder, 131072)  # type: ignore[arg-type]
    assert recorder.max_seq_len == 4096
    _enable_cuda_graphs(load_config(["--max-total-tokens", "9000"], {}), recorder, 131072)  # type: ignore[arg-type]
    assert recorder.max_seq_len == 9000


def test_cuda_graphs_flag() -> None:
    from genserve.config import load_config

    assert load_config([]).cuda_graphs is None  # default buckets, chosen at start-up
    assert load_config(["--cuda-graphs", "0"]).cuda_graphs == ()
    assert load_config(["--cuda-graphs", "4,1,2"]).cuda_graphs == (1, 2, 4)
    with pytest.raises(SystemExit):
        load_config(["--cuda-graphs", "-1"])


def test_gpu_table_merges_eager_and_compiled_runs(tmp_path: Path) -> None:
    import json

    from genserve.bench.gpu_table import main as table_main

    def summary(system: str, conc: int, tok_s: float) -> dict[str, object]:
        return {
            "system": system,
            "concurrency": conc,
            "throughput_tok_s": tok_s,
            "itl_ms": {"p50": 10.0},
            "ttft_steady_ms": {"p50": 30.0},
        }

    eager = {
        "genserve": [summary("genserve", 1, 200.0), summary("genserve", 64, 6400.0)],
        "baselines": [summary("hf_generate", 1, 10.0), summary("hf_generate", 64, 640.0)],
    }
    compiled = {
        "genserve": [summary("genserve", 1, 190.0)],  # the short level of the compile call
        "baselines": [summary("hf_static_compile", 1, 100.0)],
    }
    (tmp_path / "a.json").write_text(json.dumps(eager))
    (tmp_path / "b.json").write_text(json.dumps(compiled))
    out = tmp_path / "out"
    table_main(
        [
            "--out",
            str(out),
            "--device",
            "H100",
            f"8B={tmp_path / 'a.json'}",
            f"8B={tmp_path / 'b.json'}",
        ]
    )
    rows = json.loads((out / "gpu-table.json").read_text())["rows"]
    assert [(r["streams"], r["genserve_tok_s"]) for r in rows] == [(1, 200.0), (64, 6400.0)]
    assert rows[0]["x_hf_eager"] == 20.0 and rows[0]["x_hf_compile"] == 2.0
    assert "x_hf_compile" not in rows[1]
    assert "| 8B | 64 | 6,400 |" in (out / "gpu-table.md").read_text()
