"""The LoRA delta paths of genserve.model.lora against a per-row reference: the BGMV CPU
kernel, the batched (padded segments) torch path and the segment-at-a-time torch path, with
base-model rows, adapters of different ranks, pieces an adapter does not adapt, slot reuse
and stacks that grow when a larger rank arrives."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.lora import LoraHook, SlotWeights, StepAdapters

PIECES = (12, 4, 4)  # a fused q/k/v-like projection: output columns per piece
IN = 10


def slot_weights(
    rank: int, pieces: tuple[int, ...], seed: int, dtype: torch.dtype
) -> tuple[SlotWeights, torch.Tensor]:
    """Random adapter for ``pieces`` (indices into PIECES) and its dense delta matrix
    ``[out, in]`` (``Σ B_p A_p`` placed at each piece's columns) as the reference."""
    gen = torch.Generator().manual_seed(seed)
    out = sum(PIECES)
    offsets = [sum(PIECES[:i]) for i in range(len(PIECES))]
    a_rows, b = [], torch.zeros(rank * len(pieces), out)
    cols = torch.zeros(rank * len(pieces), 2, dtype=torch.int32)
    dense = torch.zeros(out, IN)
    for i, p in enumerate(pieces):
        a = torch.randn(rank, IN, generator=gen)
        bp = torch.randn(PIECES[p], rank, generator=gen)
        lo, hi = offsets[p], offsets[p] + PIECES[p]
        a_rows.append(a)
        b[i * rank : (i + 1) * rank, lo:hi] = bp.t()
        cols[i * rank : (i + 1) * rank] = torch.tensor([lo, hi], dtype=torch.int32)
        dense[lo:hi] += bp @ a
    return SlotWeights(torch.cat(a_rows).to(dtype), b.to(dtype), cols), dense


MODES = ["batched", "segments", "kernel"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_paths_match_the_reference(mode: str, dtype: torch.dtype) -> None:
    if mode == "kernel" and not cpu_kernels.load():
        pytest.skip("genserve CPU kernels unavailable (no compiler?)")
    step = StepAdapters(use_kernel=mode == "kernel")
    hook = LoraHook(step)
    dense: dict[int, torch.Tensor] = {}
    # Slot 3 first (stacks sized to it), then a larger rank in slot 0 (stacks grow), a
    # q-and-v-only adapter, and slot 1 reused by another adapter.
    for slot, rank, pieces, seed in [
        (3, 2, (0, 1, 2), 1),
        (0, 8, (0, 2), 2),
        (1, 4, (1,), 3),
        (1, 3, (0, 1, 2), 4),
    ]:
        step.num_slots = max(step.num_slots, slot + 1)
        weights, dense[slot] = slot_weights(rank, pieces, seed, dtype)
        hook.set_slot(slot, weights)
    hook.set_slot(2, None)  # an adapter that does not target this projection
    dense[2] = torch.zeros(sum(PIECES), IN)
    # "segments": one long segment beside short ones, where padding would not pay.
    long_segment = [0] * 20 + [3, -1, 1, 2]
    row_slots = long_segment if mode == "segments" else [3, -1, 0, 1, 0, -1, 2, 3, 1, 1]
    step.set_rows(row_slots, torch.device("cpu"))
    assert step.batched == (mode == "batched")
    x = torch.randn(len(row_slots), IN).to(dtype)
    base = torch.randn(len(row_slots), sum(PIECES)).to(dtype)
    got = hook.add_delta(x, base.clone()).float()
    want = base.float().clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            want[row] += dense[slot] @ x[row].float()
    tol = 1e-4 if dtype == torch.float32 else 0.15
    rtol = 0.0 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol, rtol=rtol), (got - want).abs().max()
    for row, slot in enumerate(row_slots):  # base rows are untouched, bit for bit
        if slot < 0:
            assert torch.equal(got[row], base[row].float())


def test_a_step_without_adapter_rows_changes_nothing() -> None:
    step = StepAdapters()
    hook = LoraHook(step)
    step.num_slots = 1
    hook.set_slot(0, slot_weights(2, (0,), 0, torch.float32)[0])
    step.set_rows([-1, -1], torch.device("cpu"))
    y = torch.randn(2, sum(PIECES))
    assert torch.equal(hook.add_delta(torch.randn(2, IN), y.clone()), y)
