"""--deterministic's kernels: a row's result does not depend on the rows it shares a call
with, bit for bit.  Each op is called on a batch and on every row alone (or on batches of
other sizes) and the rows must be equal, not close."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")

BLOCK_SIZE = 16


@pytest.fixture
def batch_invariant() -> Iterator[None]:
    torch.ops.genserve.set_batch_invariant(True)
    try:
        yield
    finally:
        torch.ops.genserve.set_batch_invariant(False)


def _rows_alone_equal(op: object, x: torch.Tensor) -> None:
    """``op(x)`` row by row equals ``op`` on every prefix batch of ``x`` (sizes 1..len)."""
    full = op(x)  # type: ignore[operator]
    for rows in (1, 2, 7, 8, 12, 13, 33, x.shape[0]):
        part = op(x[:rows])  # type: ignore[operator]
        assert torch.equal(part, full[:rows]), f"{rows} rows differ from the full batch"
    for r in range(0, x.shape[0], 17):
        assert torch.equal(op(x[r : r + 1]), full[r : r + 1]), f"row {r} alone differs"  # type: ignore[operator]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matvec_rows_do_not_depend_on_the_batch(dtype: torch.dtype, batch_invariant: None) -> None:
    """Under the switch the matvec sums each row in the same order at any row count
    (registers or chunks), which --deterministic relies on for every projection.  Without it,
    bfloat16 steps of 5+ rows take AMX tiles where the CPU has them (test_matvec_amx.py)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(200, 576, generator=gen).to(dtype)
    x = torch.randn(70, 576, generator=gen).to(dtype)
    _rows_alone_equal(lambda t: torch.ops.genserve.matvec(t, weight, None), x)
    # The LM head's use: float32 rows in, float32 logits out of half-precision weights.
    _rows_alone_equal(lambda t: torch.ops.genserve.matvec(t, weight, None), x.float())


def test_panel_linear_rows_do_not_depend_on_the_batch(batch_invariant: None) -> None:
    """float32 panels: no one-row stream and no GEMM past 256 rows under the switch."""
    from genserve.model.weight_panels import pack_float

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(100, 576, generator=gen)
    panels = pack_float(weight)
    x = torch.randn(300, 576, generator=gen)
    _rows_alone_equal(lambda t: torch.ops.genserve.panel_linear(t, panels, 100, None), x)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_panel_rows_do_not_depend_on_the_batch(
    method: str, dtype: torch.dtype, batch_invariant: None
) -> None:
    from genserve.model.quantization import quantize
    from genserve.model.weight_panels import QuantizedPanels

    gen = torch.Generator().manual_seed(2)
    panels = QuantizedPanels.pack(quantize(torch.randn(96, 576, generator=gen), method))
    x = torch.randn(40, 576, generator=gen).to(dtype)
    _rows_alone_equal(lambda t: panels.linear(t, None), x)


def test_one_row_takes_the_tile_path_only_under_the_switch() -> None:
    """Without the switch one row is streamed (another order of sums) - the reason the
    switch exists; with it the row equals its value inside a batch."""
    from genserve.model.quantization import quantize
    from genserve.model.weight_panels import QuantizedPanels

    gen = torch.Generator().manual_seed(3)
    panels = QuantizedPanels.pack(quantize(torch.randn(64, 2048, generator=gen), "int8"))
    x = torch.randn(5, 2048, generator=gen)
    torch.ops.genserve.set_batch_invariant(True)
    try:
        assert torch.equal(panels.linear(x[:1], None), panels.linear(x, None)[:1])
    finally:
        torch.ops.genserve.set_batch_invariant(False)


def _paged_case(
    lengths: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    num_blocks = 512
    cache = torch.randn(2, 2, num_blocks, BLOCK_SIZE, 64, generator=gen).to(dtype)
    q = torch.randn(len(lengths), 6, 64, generator=gen).to(dtype)
    free = list(range(1, num_blocks))
    random.Random(4).shuffle(free)
    width = max(math.ceil(n / BLOCK_SIZE) for n in lengths)
    table = torch.zeros(len(lengths), width, dtype=torch.int64)
    for i, n in enumerate(lengths):
        for b in range(math.ceil(n / BLOCK_SIZE)):
            table[i, b] = free.pop()
    return q, cache, table, torch.tensor(lengths, dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_of_a_sequence_does_not_depend_on_its_neighbours(
    dtype: torch.dtype, batch_invariant: None
) -> None:
    """One long context alone would be split over the threads (split-K), in a batch of many
    it would not: under the switch both give the same bits."""
    q, cache, table, lens = _paged_case([1500, 3, 700, 17, 1024, 64, 2000, 5], dtype)
    full = torch.ops.genserve.paged_decode_attention(q, cache, table, lens, 0.125, -1)
    for i in range(q.shape[0]):
        alone = torch.ops.genserve.paged_decode_attention(
            q[i : i + 1], cache, table[i : i + 1], lens[i : i + 1], 0.125, -1
        )
        assert torch.equal(alone, full[i : i + 1]), f"sequence {i} alone differs"
