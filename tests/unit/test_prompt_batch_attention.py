"""Whole prompts of a step attended in one padded SDPA call (``model/prompt_batch.py``, the
CUDA default): the same outputs as one call per prompt, beside decodes and a chunk that
continues from the cache; and the cases it leaves to the per-prompt loop."""

from __future__ import annotations

import pytest
import torch

from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.prompt_batch import prompt_batch

BLOCK_SIZE = 4
KV_HEADS, HEADS, HEAD_DIM = 2, 4, 8


def _step(batch_prompts: bool, dtype: torch.dtype, window: int | None) -> tuple[torch.Tensor, bool]:
    gen = torch.Generator().manual_seed(0)
    backend = TorchPagedAttention(torch.device("cpu"), batch_prompts=batch_prompts)
    cache = torch.randn(
        backend.kv_cache_shape(64, BLOCK_SIZE, KV_HEADS, HEAD_DIM), generator=gen
    ).to(dtype)
    # Two decodes, three whole prompts (5, 7, 6 tokens) and a chunk after 8 cached tokens.
    seqs = [
        SeqSpec(1, 9, (0, 1, 2)),
        SeqSpec(1, 3, (3,)),
        SeqSpec(5, 0, (4, 5)),
        SeqSpec(7, 0, (6, 7)),
        SeqSpec(6, 0, (8, 9)),
        SeqSpec(3, 8, (10, 11, 12)),
    ]
    meta = backend.build(seqs, 2, BLOCK_SIZE)
    tokens = sum(s.num_tokens for s in seqs)
    q = torch.randn(tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    meta.write_kv(cache, k, v)
    out = meta.attend(q, k, v, cache, 0.3, window)
    return out, getattr(meta, "fresh", None) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_prompts_equal_one_call_per_prompt(dtype: torch.dtype) -> None:
    batched, used = _step(True, dtype, None)
    assert used
    looped, used = _step(False, dtype, None)
    assert not used
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(batched, looped, atol=tol, rtol=tol)


def test_a_sliding_window_keeps_the_per_prompt_path() -> None:
    # The metadata holds the batch, but a windowed layer attends prompt by prompt.
    windowed, _ = _step(True, torch.float32, 3)
    looped, _ = _step(False, torch.float32, 3)
    assert torch.equal(windowed, looped)


def test_no_batch_for_one_prompt_or_too_much_padding() -> None:
    backend = TorchPagedAttention(torch.device("cpu"), batch_prompts=True)

    def batch(seqs: list[SeqSpec]) -> object:
        return backend.build(seqs, 0, BLOCK_SIZE).fresh  # type: ignore[attr-defined]

    assert batch([SeqSpec(5, 0, (0, 1))]) is None
    assert batch([SeqSpec(5, 0, (0, 1)), SeqSpec(3, 4, (2, 3))]) is None  # one is a chunk
    short = [SeqSpec(1, 0, (i,)) for i in range(3)]
    assert batch([*short, SeqSpec(30, 0, tuple(range(3, 11)))]) is None  # padding > tokens
    assert batch([SeqSpec(6, 0, (0, 1)), SeqSpec(4, 0, (2,))]) is not None
    assert prompt_batch([(0, 6), (6, 4)], torch.device("cpu")) is not None
    # The CPU default is one call per prompt.
    assert TorchPagedAttention(torch.device("cpu")).batch_prompts is False
