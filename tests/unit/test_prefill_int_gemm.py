"""The register-tiled integer GEMM for K-quant prompt chunks on CPUs without a native bfloat16
product (``genserve::kquant_linear_int_gemm``, kernels/prefill_int_gemm_cpu.cpp):

* the product: within float32 scaling error of a float64 product of the *same* Q8_K int8
  activations (``kquant_quantize``) and gguf-py's dequantized weights, over a matrix of three
  segments (Q4_K, Q6_K, Q5_K rows fused, an odd row count: a weight-row pair split by a
  segment end and a last unpaired row), for every activation-row tail (1-4 rows past a tile of
  4), a bias, one and two threads, bfloat16 activations;
* it agrees with the one-row integer kernel (``kquant_linear`` on AVX2) to float32 rounding;
* ``KQuantWeight.linear`` takes it from ``int_gemm_rows`` rows on, and ``int_gemm_min_rows``
  chooses it only where the bfloat16 GEMM does not run: on an AVX512-BF16 machine with
  ``GENSERVE_CPU_FEATURES_MASK`` hiding AVX-512 (the AVX2 build's choice, emulated), never in
  deterministic mode;
* bad input is refused with a message.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import prefill_gemm
from genserve.kernels.cpu_features import parse_mask
from genserve.kernels.int_dot import Isa
from genserve.model.kquants import KQuantWeight, cat_kquant
from genserve.testing.tiny_gguf import random_blocks

CODES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _usable() -> bool:
    return cpu_kernels.load() and bool(torch.ops.genserve.kquant_int_gemm_available())


pytestmark = pytest.mark.skipif(not _usable(), reason="needs the CPU kernels and AVX2")


def _matrix(qtype: str, rows: int, cols: int, seed: int) -> KQuantWeight:
    raw = random_blocks(GGMLQuantizationType[qtype], rows, cols, seed=seed)
    return KQuantWeight.from_blocks(raw, qtype)


@pytest.fixture(scope="module")
def mixed() -> KQuantWeight:
    parts = [_matrix("Q4_K", 41, 512, 1), _matrix("Q6_K", 24, 512, 2), _matrix("Q5_K", 10, 512, 3)]
    return cat_kquant(parts)


def _gguf_py(w: KQuantWeight) -> torch.Tensor:
    pieces = [
        dequantize(block.numpy(), GGMLQuantizationType[qtype]) for qtype, block in w.segments()
    ]
    return torch.from_numpy(np.concatenate(pieces).reshape(w.out_features, w.in_features))


def _gemm(w: KQuantWeight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    codes = [CODES[t] for t in w.types]
    out: torch.Tensor = torch.ops.genserve.kquant_linear_int_gemm(
        x, w.data, codes, list(w.row_counts), bias
    )
    return out


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double().abs() @ w.double().abs().T


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 16, 33])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_a_float64_product_of_the_same_int8_activations(
    mixed: KQuantWeight, m: int, threads: int
) -> None:
    torch.manual_seed(100 + m)
    w = _gguf_py(mixed)
    x = torch.randn(m, mixed.in_features) * torch.rand(m, 1) * 4
    bias = torch.randn(mixed.out_features)
    q, d, _ = torch.ops.genserve.kquant_quantize(x)
    xq = (q.double().view(m, -1, 256) * d.double()[..., None]).view(m, -1)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _gemm(mixed, x, bias)
    finally:
        torch.set_num_threads(saved)
    expected = xq @ w.double().T + bias.double()
    assert got.dtype == torch.float32 and got.shape == (m, mixed.out_features)
    assert ((got.double() - expected).abs() <= 2e-6 * _bound(xq, w) + 1e-5).all()


def test_agrees_with_the_one_row_integer_kernel_and_keeps_bfloat16(mixed: KQuantWeight) -> None:
    torch.manual_seed(7)
    x = torch.randn(21, mixed.in_features)
    one_row = mixed.serving(int(Isa.AVX2)).linear(x, None)
    tiled = _gemm(mixed, x)
    assert torch.allclose(tiled, one_row, rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()
    got = _gemm(mixed, xb)
    assert got.dtype == torch.bfloat16
    ref = mixed.serving(int(Isa.AVX2)).linear(xb.float(), None)
    assert torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_linear_takes_it_from_int_gemm_rows(mixed: KQuantWeight) -> None:
    torch.manual_seed(8)
    w = mixed.serving(int(Isa.AVX2), 0, 8)
    many, few = torch.randn(8, 512), torch.randn(7, 512)
    assert torch.equal(w.linear(many, None), _gemm(mixed, many))
    assert torch.equal(w.linear(few, None), mixed.serving(int(Isa.AVX2)).linear(few, None))


@pytest.fixture
def restore() -> Iterator[None]:
    hidden, invariant = cpu_kernels.hidden_features(), cpu_kernels._settings.batch_invariant
    yield
    cpu_kernels._settings.hidden_features = hidden
    torch.ops.genserve.set_hidden_cpu_features(list(hidden))
    cpu_kernels._settings.batch_invariant = invariant
    torch.ops.genserve.set_batch_invariant(invariant)


def _hide(mask: str) -> None:
    cpu_kernels._settings.hidden_features = parse_mask(mask)
    torch.ops.genserve.set_hidden_cpu_features(list(parse_mask(mask)))


def test_chosen_only_without_native_bfloat16(
    restore: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(prefill_gemm.ENV_INT_GEMM_MIN_ROWS, raising=False)
    _hide("")
    if torch.ops.genserve.bf16_gemm_native():
        assert prefill_gemm.int_gemm_min_rows() == 0
    for mask in ("avx2", "avx512"):  # an AVX2-only CPU; AVX-512 without VNNI / bfloat16
        _hide(mask)
        assert prefill_gemm.bf16_min_rows() == 0
        assert prefill_gemm.int_gemm_min_rows() == prefill_gemm.INT_GEMM_MIN_ROWS
    monkeypatch.setenv(prefill_gemm.ENV_INT_GEMM_MIN_ROWS, "0")
    assert prefill_gemm.int_gemm_min_rows() == 0
    monkeypatch.delenv(prefill_gemm.ENV_INT_GEMM_MIN_ROWS)
    cpu_kernels._settings.batch_invariant = True
    torch.ops.genserve.set_batch_invariant(True)
    assert prefill_gemm.int_gemm_min_rows() == 0


def test_bad_input_is_refused(mixed: KQuantWeight) -> None:
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.genserve.kquant_linear_int_gemm(torch.randn(2, 100), mixed.data, [12], [1], None)
    with pytest.raises(RuntimeError, match="bytes"):
        torch.ops.genserve.kquant_linear_int_gemm(torch.randn(2, 512), mixed.data, [12], [3], None)
    with pytest.raises(RuntimeError, match="not Q4_K"):
        torch.ops.genserve.kquant_linear_int_gemm(torch.randn(2, 512), mixed.data, [8], [3], None)
    with pytest.raises(RuntimeError, match="bias"):
        _gemm(mixed, torch.randn(2, 512), torch.randn(3))
