"""The many-row K-quant path (``genserve::kquant_linear_bf16``, kernels/prefill_gemm_cpu.cpp):
super-blocks decoded to bfloat16, then torch's bfloat16 GEMM, for prompt chunks on the integer
path (kernels/prefill_gemm.py chooses).

* the decode: bit for bit gguf-py's float32 values rounded to the nearest bfloat16, over a
  matrix of three segments (Q4_K, Q6_K, Q5_K rows fused);
* the product: within bfloat16 output rounding of a float64 product of the bfloat16 weights and
  the bfloat16-rounded activations, for the whole matrix as one panel and in panels that split
  segments, with a bias;
* ``KQuantWeight.linear`` takes it from ``bf16_rows`` rows on, the integer kernel below;
* the same for the integer kernel's block layout (``genserve::int_dot_linear_bf16``: Q8_0, Q4_0,
  Q4_1, per-channel int8; ``IntDotPanels``), against the reference's dequantized rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import prefill_gemm
from genserve.kernels.int_dot import Isa
from genserve.model.int_dot_panels import IntDotPanels
from genserve.model.kquants import KQuantWeight, cat_kquant
from genserve.model.quantization import QuantizedWeight, quantize_int4, quantize_int8
from genserve.testing.tiny_gguf import random_blocks


def _avx512() -> bool:
    return cpu_kernels.load() and "avx512bw" in Path("/proc/cpuinfo").read_text()


needs_decode = pytest.mark.skipif(
    not _avx512(), reason="the bfloat16 decode needs the CPU kernels and AVX-512 (F, BW, VL)"
)
CODES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def _matrix(qtype: str, rows: int, cols: int, seed: int) -> KQuantWeight:
    raw = random_blocks(GGMLQuantizationType[qtype], rows, cols, seed=seed)
    return KQuantWeight.from_blocks(raw, qtype)


@pytest.fixture(scope="module")
def mixed() -> KQuantWeight:
    parts = [_matrix("Q4_K", 40, 512, 1), _matrix("Q6_K", 24, 512, 2), _matrix("Q5_K", 9, 512, 3)]
    return cat_kquant(parts)


def _gguf_py_bf16(w: KQuantWeight) -> torch.Tensor:
    pieces = [
        dequantize(block.numpy(), GGMLQuantizationType[qtype]) for qtype, block in w.segments()
    ]
    values = torch.from_numpy(np.concatenate(pieces).reshape(w.out_features, w.in_features))
    return values.to(torch.bfloat16)


def _args(w: KQuantWeight) -> tuple[torch.Tensor, list[int], list[int]]:
    return w.data, [CODES[t] for t in w.types], list(w.row_counts)


@needs_decode
def test_decode_is_gguf_py_rounded_to_bfloat16(mixed: KQuantWeight) -> None:
    data, codes, rows = _args(mixed)
    got = torch.ops.genserve.kquant_to_bf16(data, codes, rows, mixed.in_features)
    expected = _gguf_py_bf16(mixed)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@needs_decode
@pytest.mark.parametrize("panel_rows", [0, 24, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_product_within_bfloat16_rounding(
    mixed: KQuantWeight, panel_rows: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(37, mixed.in_features, generator=gen).to(dtype)
    bias = torch.randn(mixed.out_features, generator=gen)
    data, codes, rows = _args(mixed)
    got = torch.ops.genserve.kquant_linear_bf16(x, data, codes, rows, bias, panel_rows)
    assert got.dtype == dtype and got.shape == (37, mixed.out_features)
    w = _gguf_py_bf16(mixed).double()
    xb = x.to(torch.bfloat16).double()
    ref = xb @ w.T + bias.to(torch.bfloat16).double()
    bound = (xb.abs() @ w.abs().T) * 1e-5 + ref.abs() * 2.0**-8 + 1e-6
    assert bool(((got.double() - ref).abs() <= bound).all())


@needs_decode
def test_linear_switches_path_at_bf16_rows(mixed: KQuantWeight) -> None:
    served = mixed.serving(int(Isa.AUTO), bf16_rows=16)
    data, codes, rows = _args(mixed)
    x = torch.randn(16, mixed.in_features)
    assert torch.equal(
        served.linear(x, None),
        torch.ops.genserve.kquant_linear_bf16(x, data, codes, rows, None, 0),
    )
    assert torch.equal(
        served.linear(x[:15], None),
        torch.ops.genserve.kquant_linear(x[:15], data, codes, rows, None, int(Isa.AUTO)),
    )


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
def test_bad_inputs_are_refused(mixed: KQuantWeight) -> None:
    data, codes, rows = _args(mixed)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.genserve.kquant_linear_bf16(torch.zeros(2, 500), data, codes, rows, None, 0)
    with pytest.raises(RuntimeError, match="not Q4_K"):
        torch.ops.genserve.kquant_linear_bf16(torch.zeros(2, 512), data, [8], [73], None, 0)
    with pytest.raises(RuntimeError, match="segments need"):
        torch.ops.genserve.kquant_linear_bf16(
            torch.zeros(2, 512), data, codes, [40, 24, 8], None, 0
        )
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.genserve.kquant_linear_bf16(
            torch.zeros(2, 512), data, codes, rows, torch.zeros(3), 0
        )


def test_choice_off_where_deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "batch_invariant", lambda: True)
    assert prefill_gemm.bf16_min_rows() == 0


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
def test_choice_follows_the_cpu_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    native = bool(torch.ops.genserve.bf16_gemm_native())
    assert prefill_gemm.bf16_min_rows() == (prefill_gemm.BF16_MIN_ROWS if native else 0)
    blocks = prefill_gemm.BLOCK_BF16_MIN_ROWS_AMX if cpu_kernels.amx_bf16() else 0
    assert prefill_gemm.bf16_min_rows(blocks=True) == (blocks if native else 0)
    # With AMX tiles (bfloat16 is then native) the block formats hand 128+ rows to the GEMM.
    monkeypatch.setattr(torch.ops.genserve, "bf16_gemm_native", lambda: True)
    for amx, rows in ((True, prefill_gemm.BLOCK_BF16_MIN_ROWS_AMX), (False, 0)):
        monkeypatch.setattr(cpu_kernels, "amx_bf16", lambda amx=amx: amx)
        assert prefill_gemm.bf16_min_rows(blocks=True) == rows
    monkeypatch.undo()
    monkeypatch.setenv(prefill_gemm.ENV_MIN_ROWS, "5")
    monkeypatch.setenv(prefill_gemm.ENV_BLOCK_MIN_ROWS, "7")
    assert prefill_gemm.bf16_min_rows() == (5 if native else 0)
    assert prefill_gemm.bf16_min_rows(blocks=True) == (7 if native else 0)


# ------------------------------------------------- the block formats (Q8_0, Q4_0, Q4_1)
def _block_formats() -> dict[str, Callable[[torch.Tensor], QuantizedWeight]]:
    from genserve.bench.int_dot_speed import q4_0, q8_0

    return {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": quantize_int4, "int8 per-channel": quantize_int8}


@needs_decode
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0", "Q4_1", "int8 per-channel"])
@pytest.mark.parametrize("panel_cols", [0, 32])
def test_block_formats_within_bfloat16_rounding(fmt: str, panel_cols: int) -> None:
    gen = torch.Generator().manual_seed(11)
    k = 100 if fmt == "int8 per-channel" else 256  # per-channel: K not a multiple of 32
    quant = _block_formats()[fmt](torch.randn(70, k, generator=gen))  # a partial last panel
    panels = IntDotPanels.pack(quant)
    x = torch.randn(21, k, generator=gen)
    bias = torch.randn(70, generator=gen)
    got = torch.ops.genserve.int_dot_linear_bf16(
        x, panels.data, panels.scales, panels.mins, panels.bits, 70, bias, panel_cols
    )
    assert got.dtype == torch.float32 and got.shape == (21, 70)
    # the weights as the reference dequantizes them, rounded to bfloat16
    w = panels.dequantize_rows(torch.arange(70), torch.float32).to(torch.bfloat16).double()
    xb = x.to(torch.bfloat16).double()
    ref = xb @ w.T + bias.double()
    rounding = ref.abs() * 2.0**-7 + bias.abs().double() * 2.0**-8
    bound = (xb.abs() @ w.abs().T) * 1e-5 + rounding + 1e-6
    assert bool(((got.double() - ref).abs() <= bound).all())


@needs_decode
def test_block_formats_switch_path_at_bf16_rows() -> None:
    from genserve.bench.int_dot_speed import q4_0

    panels = dataclasses.replace(IntDotPanels.pack(q4_0(torch.randn(64, 256))), bf16_rows=8)
    x = torch.randn(8, 256)
    args = (panels.data, panels.scales, panels.mins, panels.bits, 64)
    assert torch.equal(
        panels.linear(x, None), torch.ops.genserve.int_dot_linear_bf16(x, *args, None, 0)
    )
    assert torch.equal(
        panels.linear(x[:7], None),
        torch.ops.genserve.int_dot_linear(x[:7], *args, None, int(Isa.AUTO)),
    )
