"""The quantized weight format (model/quantization.py), its column panels
(model/weight_panels.py) and genserve's ``qpanel_linear`` CPU kernel, against float64 products
of the dequantized reference."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.quantization import (
    QuantizationError,
    QuantizedWeight,
    cat_rows,
    choose_method,
    quantize_int4,
    quantize_int8,
)
from genserve.model.weight_panels import QuantizedPanels

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """GGUF Q8_0's layout: symmetric int8 with a float16 scale per 32 weights."""
    n, k = weight.shape
    w = weight.view(n, k // 32, 32)
    scales = (w.abs().amax(-1) / 127).to(torch.float16)
    q = torch.round(w / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q.view(n, k), scales, None, 8, 32)


def test_int8_is_per_channel_and_within_half_a_step() -> None:
    w = _weight(48, 96)
    q = quantize_int8(w)
    assert q.data.dtype == torch.int8 and q.group == 96 and q.scales.shape == (48, 1)
    step = q.scales.float()  # [48, 1]
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert q.nbytes == 48 * 96 + 48 * 2


def test_int4_uses_ggufs_nibble_order_and_q4_1_bounds() -> None:
    w = _weight(16, 64, seed=1)
    q = quantize_int4(w)
    assert q.data.shape == (16, 32) and q.scales.shape == (16, 2) and q.mins is not None
    # Byte j of a group holds weights j (low nibble) and j + 16 (high nibble).
    values = torch.cat(((q.data & 15).view(16, 2, 16), (q.data >> 4).view(16, 2, 16)), -1)
    expected = q.scales.float()[..., None] * values.float() + q.mins.float()[..., None]
    assert torch.equal(q.dequantize(), expected.view(16, 64))
    step = q.scales.float().repeat_interleave(32, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-3 * step + 1e-6).all()


def test_int4_refuses_features_off_the_group() -> None:
    with pytest.raises(QuantizationError, match="divisible by 32"):
        quantize_int4(_weight(4, 40))


def test_rows_columns_and_cat_rows_match_the_dequantized_matrix() -> None:
    w = _weight(40, 128, seed=2)
    for q in (quantize_int4(w), _q8_0(w)):
        full = q.dequantize()
        index = torch.tensor([5, 0, 39, 7])
        assert torch.equal(q.rows(index).dequantize(), full[index])
        assert torch.equal(q.columns(32, 96).dequantize(), full[:, 32:96])
        assert torch.equal(cat_rows([q.rows(slice(0, 9)), q.rows(slice(9, 40))]).dequantize(), full)
        with pytest.raises(QuantizationError):
            q.columns(16, 96)
    with pytest.raises(QuantizationError):
        cat_rows([quantize_int4(w), _q8_0(w)])


def _check(q: QuantizedWeight, rows: int, dtype: torch.dtype, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, q.in_features, generator=gen).to(dtype)
    b = torch.randn(q.out_features, generator=gen) if bias else None
    out = QuantizedPanels.pack(q).linear(x, b)
    assert out.dtype == dtype and out.shape == (rows, q.out_features)
    ref = x.double() @ q.dequantize().double().t()
    if b is not None:
        ref = ref + b.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    assert (out.double() - ref).abs().max() <= tol * ref.abs().max()


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 11, 12, 13, 32, 33, 130])
@pytest.mark.parametrize("fmt", ["int8", "q8_0", "int4"])
def test_qpanel_linear_equals_the_dequantized_product(rows: int, fmt: str) -> None:
    # 1 row: dequantized in registers; more: chunks dequantized into L1 and tiles of 12 rows
    # (AVX-512; 3 with AVX2) plus a remainder; over 128 rows, a second row block.  98 output
    # rows leave a part-filled last panel; 160 inputs are five groups of 32 and one chunk
    # boundary (128) inside the matrix.
    w = _weight(98, 160, seed=rows)
    q = {"int8": quantize_int8, "q8_0": _q8_0, "int4": quantize_int4}[fmt](w)
    _check(q, rows, torch.float32, bias=False)


@needs_kernels
def test_qpanel_linear_bias_bfloat16_and_a_large_matrix() -> None:
    w = _weight(3000, 576, seed=3)
    for q in (quantize_int8(w), quantize_int4(w)):
        _check(q, 1, torch.float32, bias=True)
        _check(q, 4, torch.bfloat16, bias=True)
        _check(q, 64, torch.float32, bias=True)


@needs_kernels
def test_per_channel_int8_with_features_off_the_group_of_32() -> None:
    q = quantize_int8(_weight(40, 72, seed=5))  # 72 = 2 * 32 + 8: a partial last block
    for rows in (1, 7):
        _check(q, rows, torch.float32, bias=True)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "int4"])
def test_panels_look_up_the_dequantized_rows(fmt: str) -> None:
    # A tied embedding reads its rows out of the LM head's panels.
    q = {"int8": quantize_int8, "q8_0": _q8_0, "int4": quantize_int4}[fmt](_weight(70, 96))
    panels = QuantizedPanels.pack(q)
    ids = torch.tensor([0, 69, 31, 32, 16, 15, 47])
    assert torch.equal(panels.dequantize_rows(ids, torch.float32), q.dequantize()[ids])
    assert panels.data.shape[:2] == (3, 96) and panels.scales.shape[0] == 3


@needs_kernels
def test_qpanel_linear_rejects_inconsistent_arguments() -> None:
    p = QuantizedPanels.pack(quantize_int4(_weight(8, 64)))
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="mins"):
        torch.ops.genserve.qpanel_linear(x, p.data, p.scales, None, 4, 32, 8, None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        torch.ops.genserve.qpanel_linear(
            torch.randn(1, 32), p.data, p.scales, p.mins, 4, 32, 8, None
        )
    with pytest.raises(RuntimeError, match="disagree on K or N"):
        torch.ops.genserve.qpanel_linear(x, p.data, p.scales, p.mins, 4, 32, 40, None)


@pytest.mark.parametrize(
    ("requested", "from_gguf", "kernels", "expected"),
    [
        (None, True, True, "gguf"),  # a .gguf on CPU keeps its blocks
        (None, True, False, None),  # no kernels (CUDA, disabled): dequantized
        (None, False, True, None),
        ("none", True, True, None),
        ("eetq", False, True, "int8"),  # TGI's name
        ("int4", False, False, "int4"),  # asked for: the torch reference serves it
    ],
)
def test_default_method(
    requested: str | None, from_gguf: bool, kernels: bool, expected: str | None
) -> None:
    assert choose_method(requested, from_gguf, kernels).method == expected
