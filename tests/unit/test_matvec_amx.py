"""bfloat16 steps of five rows and more on AMX tiles (``kernels/matvec_amx_cpu.cpp``), inside
``genserve::matvec``: against a float64 product (every product exact, float32 sums), with W
rows past the last block of 32 (VDPBF16PS's), one and two B tiles and more than one pass
(16, 17-32 and 33+ rows), the LM head's float32 rows; and off under --deterministic, whose
rows must not depend on the rows beside them.  Runs only where the CPU has AMX-BF16."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels


def _amx() -> bool:
    return cpu_kernels.load() and bool(torch.ops.genserve.matvec_amx_available())


pytestmark = pytest.mark.skipif(
    not _amx(), reason="needs genserve's CPU kernels and a CPU with AMX-TILE and AMX-BF16"
)


@pytest.fixture
def without_amx() -> Iterator[None]:
    """The same process with AMX-BF16 treated as absent: VDPBF16PS for every row count."""
    torch.ops.genserve.set_hidden_cpu_features(["amx-bf16"])
    try:
        yield
    finally:
        torch.ops.genserve.set_hidden_cpu_features(list(cpu_kernels.hidden_features()))


def _case(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("rows", [5, 8, 16, 17, 32, 33, 70])
@pytest.mark.parametrize(("n", "k"), [(96, 576), (100, 2048), (37, 64)])
def test_tiles_match_a_float64_product(rows: int, n: int, k: int) -> None:
    x, w = _case(rows, n, k, rows * n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = x.double() @ w.double().t()
    # float32 rows of bf16 values (the LM head's): float32 sums, unrounded
    logits = torch.ops.genserve.matvec(x.float(), w, None)
    assert logits.dtype == torch.float32 and logits.shape == (rows, n)
    tolerance = (x.double().abs() @ w.double().abs().t()) * 2.0**-20 + 1e-6
    assert bool(((logits.double() - expected).abs() <= tolerance).all())
    # bf16 rows: the same sums, rounded once; with a bias
    out = torch.ops.genserve.matvec(x, w, bias)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(
        out.double(), expected + bias.double(), atol=8e-3 * k**0.5, rtol=8e-3
    )


def test_the_tiles_run_and_sum_differently_from_vdpbf16ps(without_amx: None) -> None:
    """Proof the tiles are taken: their float32 sums are in another order than VDPBF16PS's,
    so some logits differ in the last bits (and only there)."""
    x, w = _case(8, 256, 2048, 5)
    plain = torch.ops.genserve.matvec(x.float(), w, None)
    torch.ops.genserve.set_hidden_cpu_features([])
    tiled = torch.ops.genserve.matvec(x.float(), w, None)
    assert not torch.equal(tiled, plain)
    torch.testing.assert_close(tiled, plain, atol=1e-3, rtol=1e-5)


def test_four_rows_and_deterministic_stay_on_vdpbf16ps(without_amx: None) -> None:
    x, w = _case(8, 256, 2048, 7)
    reference = torch.ops.genserve.matvec(x.float(), w, None)
    torch.ops.genserve.set_hidden_cpu_features([])
    assert torch.equal(torch.ops.genserve.matvec(x[:4].float(), w, None), reference[:4])
    torch.ops.genserve.set_batch_invariant(True)
    try:
        assert torch.equal(torch.ops.genserve.matvec(x.float(), w, None), reference)
    finally:
        torch.ops.genserve.set_batch_invariant(False)
