"""genserve's C++ paged decode attention against a float64 reference computed from the same
block pool, and the attention backend's use of it (with the torch path as the fallback)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention, select_backend

BLOCK_SIZE = 16

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    seqs: list[SeqSpec],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Plain float64 attention of each sequence's one query over its context."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for i, seq in enumerate(seqs):
        length = seq.context_len
        blocks = torch.tensor(seq.block_ids[: math.ceil(length / BLOCK_SIZE)])
        # [2, kv_heads, context, head_dim]
        ctx = cache[:, :, blocks].reshape(2, num_kv_heads, -1, head_dim)[:, :, :length].double()
        first = max(0, length - window) if window is not None else 0
        for h in range(num_heads):
            k = ctx[0, h // group, first:]
            v = ctx[1, h // group, first:]
            weights = torch.softmax(k @ q[i, h].double() * scale, dim=0)
            out[i, h] = weights @ v
    return out


def _case(
    dtype: torch.dtype, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[SeqSpec]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 96
    cache = torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    free = list(range(1, num_blocks))
    rng.shuffle(free)  # scattered, unordered blocks: the table, not adjacency, must be used
    seqs = []
    for length in [1, 15, 16, 17, 33, 100, 150][:num_seqs]:
        needed = math.ceil(length / BLOCK_SIZE)
        seqs.append(SeqSpec(1, length - 1, tuple(free[:needed])))
        free = free[needed:]
    return q.to(dtype), cache.to(dtype), seqs


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)]
)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (6, 2, 40)]
)
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_matches_float64_reference(
    dtype: torch.dtype,
    tolerance: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
) -> None:
    q, cache, seqs = _case(dtype, 7, num_heads, num_kv_heads, head_dim, seed=head_dim)
    table = torch.zeros(len(seqs), max(len(s.block_ids) for s in seqs), dtype=torch.int64)
    for i, seq in enumerate(seqs):
        table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids)
    lengths = torch.tensor([s.context_len for s in seqs])
    scale = head_dim**-0.5
    out = torch.ops.genserve.paged_decode_attention(
        q, cache, table, lengths, scale, -1 if window is None else window
    )
    # The reference sees the same (rounded) inputs, so only the kernel's arithmetic differs.
    expected = _reference(q, cache, seqs, scale, window)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


def test_kernel_rejects_tables_that_do_not_cover_the_context() -> None:
    q, cache, _ = _case(torch.bfloat16, 2, 9, 3, 64, seed=1)
    short_table = torch.zeros(2, 1, dtype=torch.int64)  # one block, contexts need more
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        torch.ops.genserve.paged_decode_attention(
            q[:2], cache, short_table, torch.tensor([15, 17]), 0.125, -1
        )
    bad_ids = torch.full((2, 2), cache.shape[2], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.genserve.paged_decode_attention(
            q[:2], cache, bad_ids, torch.tensor([15, 17]), 0.125, -1
        )


def test_backend_uses_the_kernel_for_half_precision_decodes_only() -> None:
    cpu = torch.device("cpu")
    assert select_backend(cpu, BLOCK_SIZE, torch.bfloat16).name.endswith("cpu-decode-kernel")
    assert select_backend(cpu, BLOCK_SIZE, torch.float32).name == "torch-sdpa"


@pytest.mark.parametrize("window", [None, 24])
def test_backend_decodes_agree_with_the_torch_path(window: int | None) -> None:
    """A mixed step (decodes + a prefill chunk) through both backends: same decode rows
    (within bfloat16 rounding of the torch path's bf16 scores), identical prefill rows."""
    q, cache, seqs = _case(torch.bfloat16, 7, 9, 3, 64, seed=7)
    num_decodes = len(seqs)
    prefill = SeqSpec(5, 40, tuple(range(80, 84)))  # a chunk continuing from the cache
    step = [*seqs, prefill]
    q_all = torch.cat([q, torch.randn(5, 9, 64).to(torch.bfloat16)])
    k_new = torch.randn(num_decodes + 5, 3, 64).to(torch.bfloat16)
    v_new = torch.randn(num_decodes + 5, 3, 64).to(torch.bfloat16)
    outputs = []
    for use_kernel in (True, False):
        meta = TorchPagedAttention(torch.device("cpu"), use_cpu_kernel=use_kernel).build(
            step, num_decodes, BLOCK_SIZE
        )
        layer_cache = cache.clone()
        meta.write_kv(layer_cache, k_new, v_new)
        outputs.append(meta.attend(q_all, k_new, v_new, layer_cache, 0.125, window))
    kernel_out, torch_out = outputs
    torch.testing.assert_close(
        kernel_out[:num_decodes].float(), torch_out[:num_decodes].float(), atol=3e-2, rtol=3e-2
    )
    assert torch.equal(kernel_out[num_decodes:], torch_out[num_decodes:])
