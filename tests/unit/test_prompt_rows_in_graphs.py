"""Prompt tokens as decode rows of the CUDA graphs (``step_inputs.layout(prompt_rows=True)``,
``ModelRunner.launch``): a step with prompt chunks that fits a bucket replays the decode
graphs, each prompt token a row whose context ends at its position, instead of running an
eager forward (20-36 ms for a ~40-token prompt on an H100's host, against a 6 ms graphed
step).

Proved on the CPU harness of the sync-free tests (the CUDA code path with CPU kernels off,
DecodeGraphs' buffers run eagerly, the Triton attention kernels stubbed by torch): the graphs
really serve prompt steps and mixed steps, and every sampled token equals the same runner's
with prompt rows switched off (``GENSERVE_PROMPT_ROWS_IN_GRAPHS=off``: eager prompt steps),
float32.  Models whose rotation depends on the sequence's length keep eager prompt steps."""

from __future__ import annotations

import pytest
import torch

from genserve.model.attention import SeqSpec
from genserve.step import ScheduledChunk, SchedulerOutput
from genserve.worker.step_inputs import layout
from tests.conftest import TinyModelFactory
from tests.unit.test_gpu_step_sync_free import (
    GREEDY,
    SAMPLED,
    _mixed_step,
    _runner,
    _Stream,
    cuda_path_on_cpu,  # noqa: F401  (the fixture, used by name)
)


def test_layout_gives_each_prompt_token_a_decode_row() -> None:
    """The chunks keep their order (decodes, then prompts); a prompt token is a one-token
    row at its position; the chunk that samples samples its last row only."""
    step = SchedulerOutput(
        1,
        (
            ScheduledChunk("p", (5, 6, 7), 16, (0, 1), True),
            ScheduledChunk("d", (9,), 40, (2, 3, 4), True),
        ),
    )
    rows = layout(step, prompt_rows=True)
    assert [c.req_id for c in rows.chunks] == ["d", "p"]
    assert rows.pure_decode and rows.num_decodes == 4
    assert rows.seqs == [
        SeqSpec(1, 40, (2, 3, 4)),
        SeqSpec(1, 16, (0, 1)),
        SeqSpec(1, 17, (0, 1)),
        SeqSpec(1, 18, (0, 1)),
    ]
    assert rows.sample_rows() == ([0, 3], False)
    plain = layout(step)
    assert [c.req_id for c in plain.chunks] == ["d", "p"] and not plain.pure_decode
    assert list(plain.offsets) == list(rows.offsets)  # prompt logprobs read the same rows


@pytest.mark.usefixtures("cuda_path_on_cpu")
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-sampled"])
def test_prompt_and_mixed_steps_replay_the_graphs_with_the_same_tokens(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch, params: object
) -> None:
    model_dir = tiny_model_factory("llama", seed=3)
    seen = {}
    for mode in ("auto", "off"):
        monkeypatch.setenv("GENSERVE_PROMPT_ROWS_IN_GRAPHS", mode)
        runner = _runner(model_dir, explicit=True, dtype=torch.float32)
        graphs = runner._graphs
        assert graphs is not None
        stream = _Stream(runner, 4, params)  # type: ignore[arg-type]  # 12 prompt rows
        prompt_runs = graphs.num_runs
        for _ in range(3):
            stream.decode()
        step = _mixed_step(runner, stream, params)  # type: ignore[arg-type]
        before = graphs.num_runs
        out = runner.execute_model(step)
        mixed_runs = graphs.num_runs - before
        for _ in range(2):
            stream.decode()
        seen[mode] = (stream.tokens, [s.token_id for s in out.sampled], prompt_runs, mixed_runs)
    auto, off = seen["auto"], seen["off"]
    assert auto[2] == 1 and off[2] == 0, "the first prompt step replays the graphs"
    assert auto[3] == 1 and off[3] == 0, "so does the mixed step (4 decodes, 2 prompts, a chunk)"
    assert auto[0] == off[0] and auto[1] == off[1]


@pytest.mark.usefixtures("cuda_path_on_cpu")
def test_rows_past_the_largest_bucket_run_eagerly(tiny_model_factory: TinyModelFactory) -> None:
    """64 prompts of 3 tokens (192 rows, buckets up to 64): the eager prefill, as before."""
    runner = _runner(tiny_model_factory("llama", seed=3), explicit=True, dtype=torch.float32)
    assert runner._graphs is not None
    _Stream(runner, 64, GREEDY)
    assert runner._graphs.num_runs == 0


@pytest.mark.usefixtures("cuda_path_on_cpu")
def test_length_dependent_rotary_keeps_eager_prompt_steps(
    tiny_model_factory: TinyModelFactory,
) -> None:
    """Phi-3's longrope rotates a prompt token by the prompt's length, which a decode row
    does not carry: its prompt steps stay eager."""
    runner = _runner(tiny_model_factory("phi3"), explicit=True, dtype=torch.float32)
    assert runner.model.rotary_needs_lengths
    assert not runner._prompt_rows_graphed()
    llama = _runner(tiny_model_factory("llama", seed=3), explicit=True, dtype=torch.float32)
    assert llama._prompt_rows_graphed()


@pytest.mark.cuda
def test_prompt_rows_on_the_gpu_give_the_eager_prefills_tokens(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, float32: the mixed workload of the graph tests (prompts of 1-130 tokens, a
    shared prefix, a preemption) with buckets up to 64, prompt rows in the graphs and not:
    the same tokens and logprobs, and the graphs really served prompt rows."""
    from tests.unit.test_cuda_gpu import _mixed_workload
    from tests.unit.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, Driver

    model_dir = tiny_model_factory("mistral")  # sliding window inside the graph too
    outs, runs = [], []
    for mode in ("auto", "off"):
        monkeypatch.setenv("GENSERVE_PROMPT_ROWS_IN_GRAPHS", mode)
        from genserve.model.loader import ResolvedModel
        from genserve.worker.model_runner import ModelRunner

        runner = ModelRunner(
            ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cuda")
        )
        runner.enable_cuda_graphs((1, 2, 4, 8, 16, 32, 64), 1024, BLOCK_SIZE)
        runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
        runner.warmup()
        assert runner._graphs is not None
        outs.append(_mixed_workload(Driver(runner, budget=48, seed=3)))
        runs.append(runner._graphs.num_runs)
        runner.shutdown()
    assert runs[0] > runs[1], runs
    for a, b in zip(*outs, strict=True):
        assert [s.token_id for s in a.out] == [s.token_id for s in b.out], a.req_id
        assert [s.logprob for s in a.out] == pytest.approx([s.logprob for s in b.out], abs=1e-4)


@pytest.mark.usefixtures("cuda_path_on_cpu")
def test_the_graph_tests_mixed_workload_on_the_cpu_harness(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workload of the GPU test above (prompts of 1-130 tokens in chunks of a 48-token
    budget, a shared prefix, a preemption) on the CPU harness, float32, graphs' buffers with
    buckets up to 64 and a 256-token table: the same tokens and logprobs with prompt rows in
    the graphs and without, and the graphs served more steps with them (22 against 12 when
    written)."""
    from genserve.model.loader import ResolvedModel
    from genserve.worker.cuda_graphs import DecodeGraphs
    from genserve.worker.graph_plan import sampling_state
    from genserve.worker.model_runner import ModelRunner
    from tests.unit.test_cuda_gpu import _mixed_workload
    from tests.unit.test_gpu_step_sync_free import BUCKETS, CPU, MAX_POSITIONS
    from tests.unit.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, Driver

    model_dir = tiny_model_factory("llama", seed=3)  # the harness's stub has no window
    outs, runs = [], []
    for mode in ("auto", "off"):
        monkeypatch.setenv("GENSERVE_PROMPT_ROWS_IN_GRAPHS", mode)
        runner = ModelRunner(
            ResolvedModel(model_dir, "tiny"), torch.float32, CPU, explicit_transfers=True
        )
        runner.model.use_fused_gpu_ops(MAX_POSITIONS)
        runner.initialize_kv_cache(NUM_BLOCKS + 1, BLOCK_SIZE)
        runner.warmup()
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, BUCKETS, width=16, block_size=BLOCK_SIZE,
            scratch_block=NUM_BLOCKS, device=CPU, use_triton_decode=True,
        )  # fmt: skip
        runner._graphs = graphs
        runner._table, runner._penalties = sampling_state(
            runner.config.vocab_size, CPU, runner.io, graphs=True
        )
        graphs.bind_sampling(runner._table, runner._penalties)
        outs.append(_mixed_workload(Driver(runner, budget=48, seed=3)))
        runs.append(graphs.num_runs)
    assert runs[0] > runs[1] > 0, runs
    for a, b in zip(*outs, strict=True):
        assert [s.token_id for s in a.out] == [s.token_id for s in b.out], a.req_id
        assert [s.logprob for s in a.out] == pytest.approx([s.logprob for s in b.out], abs=1e-4)
