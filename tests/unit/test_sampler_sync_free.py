"""The sync-free sampler (the CUDA path, run on the CPU with explicit transfers) draws exactly
what the CPU sampler draws: same ids, same logprobs, same top alternatives, for every kind of
row, mixed in one batch (issue #29)."""

from __future__ import annotations

import torch

from genserve.step import SamplingParams
from genserve.worker.device_io import DeviceIO
from genserve.worker.sampler import Sampler, SamplingRow

CPU = torch.device("cpu")
VOCAB = 8192  # divisible into first_argmax's chunks: the CPU trick is exercised too


def _rows(prev: list[int]) -> list[SamplingRow]:
    counts = torch.bincount(torch.tensor(prev), minlength=VOCAB).float()
    out_counts = torch.bincount(torch.tensor(prev[-3:]), minlength=VOCAB).float()
    kinds = [
        SamplingParams(),
        SamplingParams(num_top_tokens=3),
        SamplingParams(temperature=0.8, seed=5),
        SamplingParams(temperature=1.1, top_k=20, seed=6),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7),
        SamplingParams(temperature=1.0, top_p=0.9999, seed=8),  # past the 64 candidates
        SamplingParams(temperature=1.0, min_p=0.05, seed=9),
        SamplingParams(temperature=1.0, typical_p=0.6, seed=10),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0.7, frequency_penalty=0.4, presence_penalty=0.3, seed=11),
        SamplingParams(logit_bias=((3, 5.0), (7, -2.0))),
        SamplingParams(temperature=0.6, top_k=5, top_p=0.9, num_top_tokens=2, seed=12),
    ]
    rows = []
    for i, p in enumerate(kinds):
        penalised = p.uses_penalties
        rows.append(
            SamplingRow(
                p,
                output_index=i,
                num_tokens=len(prev),
                token_counts=counts if penalised else None,
                output_counts=out_counts if p.presence_penalty else None,
            )
        )
    return rows


def test_sync_free_sampler_equals_cpu_sampler() -> None:
    generator = torch.Generator().manual_seed(3)
    prev = torch.randint(0, VOCAB, (40,), generator=generator).tolist()
    rows = _rows(prev)
    for trial in range(4):
        x = torch.randn(len(rows), VOCAB, generator=generator) * (2 + trial)
        plain = Sampler(CPU)(x.clone(), rows)
        sync_free = Sampler(CPU, io=DeviceIO(CPU, explicit=True))
        assert sync_free.sync_free
        out = sync_free(x.clone(), rows)
        assert out.token_ids == plain.token_ids
        assert out.logprobs == plain.logprobs
        assert out.top_tokens == plain.top_tokens
        # Rows alone or in any subset choose the same (index uploads, not list indexing).
        part = sync_free(x[2:7].clone(), rows[2:7])
        assert part.token_ids == plain.token_ids[2:7]
