"""Per-slot sampling parameters on the device (worker/sampling_table.py, issue #29): the
seeded draw computed on the device is the host's bit for bit, the sampler reading the table
samples what it samples from per-row lists, and a steady decode batch uploads no sampling
parameter: a sampled step makes as many host → device uploads as a greedy one."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from genserve.model.loader import ResolvedModel
from genserve.step import (
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from genserve.worker.device_io import DeviceIO
from genserve.worker.model_runner import ModelRunner
from genserve.worker.sampler import Sampler, SamplingRow, row_uniform
from genserve.worker.sampling_table import SamplingTable, _signed64, device_uniform
from tests.conftest import TinyModelFactory

CPU = torch.device("cpu")

SAMPLED = SamplingParams(
    temperature=0.8,
    top_k=20,
    top_p=0.9,
    min_p=0.02,
    typical_p=0.95,
    repetition_penalty=1.1,
    frequency_penalty=0.2,
    presence_penalty=0.1,
    output_frequency_penalty=0.3,
    seed=7,
)


def test_device_uniform_is_the_hosts_bit_for_bit() -> None:
    rng = random.Random(1)
    seeds = [0, 1, 2**63 - 1, 2**63, 2**64 - 1] + [rng.getrandbits(64) for _ in range(500)]
    indices = [rng.randrange(0, 1 << 20) for _ in seeds]
    device = device_uniform(
        torch.tensor([_signed64(s) for s in seeds]), torch.tensor(indices, dtype=torch.int64)
    )
    assert device.tolist() == [row_uniform(s, i) for s, i in zip(seeds, indices, strict=True)]


@pytest.mark.parametrize("sync_free", [False, True])
def test_sampler_reads_the_table_as_it_reads_rows(sync_free: bool) -> None:
    io = DeviceIO(CPU, explicit=sync_free)
    table = SamplingTable(CPU, io, capacity=2)  # grows while filled
    params = [
        SamplingParams(temperature=0.7, top_k=5, seed=3),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05, seed=2**64 - 5),
        SamplingParams(),
        SamplingParams(temperature=0.9, typical_p=0.9, top_k=50_000, seed=11),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.4, seed=4),
    ]
    vocab = 300
    counts = torch.randint(0, 3, (len(params), vocab)).float()
    rows = []
    for i, p in enumerate(params):
        table.add(f"r{i}", p, num_prompt=10 + i, num_output=3 * i)
        rows.append(SamplingRow(p, 3 * i, 10 + 4 * i, counts[i], counts[i]))
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(0))
    sampler = Sampler(CPU, io)
    plain = sampler(logits, rows)
    from_table = sampler(logits, rows, table=table.rows([f"r{i}" for i in range(len(params))]))
    assert from_table.token_ids == plain.token_ids
    assert from_table.logprobs == plain.logprobs


class _Stream:
    """``num_rows`` requests stepped by hand through the runner: prefill, then decodes whose
    input token is a placeholder read from the previous step on the device."""

    def __init__(self, runner: ModelRunner, num_rows: int, params: SamplingParams) -> None:
        self.runner = runner
        self.prompts = [(1 + i % 50, 2 + i % 7, 3 + i % 11) for i in range(num_rows)]
        news = tuple(
            NewRequestData(f"r{i}", p, len(p), 0, params) for i, p in enumerate(self.prompts)
        )
        chunks = tuple(
            ScheduledChunk(f"r{i}", p, 0, (i,), True) for i, p in enumerate(self.prompts)
        )
        self.step_id = 0
        self.tokens: list[list[int]] = [[] for _ in self.prompts]
        self._record(runner.execute_model(SchedulerOutput(0, chunks, new_requests=news)))

    def _record(self, out: RunnerOutput) -> None:
        for s in out.sampled:
            self.tokens[int(s.req_id[1:])].append(s.token_id)

    def decode(self, placeholders: bool) -> None:
        self.step_id += 1
        chunks = tuple(
            ScheduledChunk(
                f"r{i}",
                (0,) if placeholders else (self.tokens[i][-1],),
                len(p) + len(self.tokens[i]) - 1,
                (i,),
                True,
                token_from_last_step=placeholders,
            )
            for i, p in enumerate(self.prompts)
        )
        self._record(self.runner.execute_model(SchedulerOutput(self.step_id, chunks)))


def _uploads_of_a_steady_step(
    model_dir: Path, num_rows: int, params: SamplingParams, placeholders: bool
) -> tuple[int, int, list[list[int]]]:
    runner = ModelRunner(
        ResolvedModel(model_dir, "tiny"), torch.float32, CPU, explicit_transfers=True
    )
    runner.initialize_kv_cache(num_rows + 1, 16)
    stream = _Stream(runner, num_rows, params)
    stream.decode(placeholders)  # the batch's index tensors are uploaded here, once
    uploads, writes = runner.io.num_uploads, runner._table.num_slot_writes
    stream.decode(placeholders)
    stream.decode(placeholders)
    per_step = (runner.io.num_uploads - uploads) // 2
    return per_step, runner._table.num_slot_writes - writes, stream.tokens


@pytest.mark.parametrize("num_rows", [1, 64])
def test_a_steady_batch_uploads_no_sampling_parameter(
    tiny_model_factory: TinyModelFactory, num_rows: int
) -> None:
    model_dir = tiny_model_factory("llama", seed=3)
    greedy, _, _ = _uploads_of_a_steady_step(model_dir, num_rows, SamplingParams(), False)
    sampled, writes, tokens = _uploads_of_a_steady_step(model_dir, num_rows, SAMPLED, False)
    # Token ids, positions and the step's attention metadata (one packed upload): no
    # sampling parameter.
    assert sampled == greedy <= 3, (sampled, greedy)
    assert writes == 0  # no slot rewritten while its request did not change
    # Placeholders read the last step's ids on the device: same tokens, no more uploads.
    ahead, _, ahead_tokens = _uploads_of_a_steady_step(model_dir, num_rows, SAMPLED, True)
    assert ahead == sampled
    assert ahead_tokens == tokens
