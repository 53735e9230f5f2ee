"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept as super-blocks (model/kquants.py) and multiplied by
``genserve::kquant_linear`` (kernels/kquant_cpu.cpp).

Files are written by gguf-py (``genserve.testing.tiny_gguf``: gguf-py has no K-quant quantizer,
so the blocks are random but valid bytes) and the reference is gguf-py's dequantizer, which is
what transformers loads a GGUF file with:

* the layout: every K matrix read by ``GGUFWeights.quantized`` dequantizes bit for bit to
  gguf-py's values (Q/K rows in Hugging Face order), by the reference and by the kernel's decode;
* the float path: within float32 summation error of a float64 product of those weights;
* the integer paths (each the CPU has; AVX2 forced on AVX-512 machines too): within float32
  scaling error of a float64 product of the *same* int8 activations (``kquant_quantize``)
  and the same weights, so only the documented rounding of x separates them from the float path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.kernels.int_dot import Isa
from genserve.model.gguf_weights import GGUFWeights
from genserve.model.kquants import FLOAT_PATH, KQuantWeight, cat_any, cat_kquant, zero_rows
from genserve.model.quantization import QuantizationError, quantize_int4
from genserve.testing.tiny_gguf import make_tiny_gguf, random_blocks

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


def _matrix(qtype: str, rows: int, cols: int, seed: int) -> KQuantWeight:
    raw = random_blocks(GGMLQuantizationType[qtype], rows, cols, seed=seed)
    return KQuantWeight.from_blocks(raw, qtype)


def _gguf_py(w: KQuantWeight) -> torch.Tensor:
    """gguf-py's dequantization of each segment, stacked: the reference values."""
    pieces = [
        dequantize(block.numpy(), GGMLQuantizationType[qtype]) for qtype, block in w.segments()
    ]
    return torch.from_numpy(np.concatenate(pieces).reshape(w.out_features, w.in_features))


@pytest.fixture(scope="module")
def mixed() -> KQuantWeight:
    """Three segments, as a fused projection of a Q4_K_M / Q5_K_M file can hold them."""
    parts = [_matrix("Q4_K", 40, 512, 1), _matrix("Q6_K", 24, 512, 2), _matrix("Q5_K", 9, 512, 3)]
    return cat_kquant(parts)


# ---------------------------------------------------------------------------- layout
@pytest.mark.parametrize("preset", ["Q4_K_M", "Q5_K_M"])
def test_gguf_k_matrices_dequantize_bit_for_bit_to_gguf_py(tmp_path: Path, preset: str) -> None:
    path = make_tiny_gguf(tmp_path / f"{preset}.gguf", preset, seed=3)
    with GGUFWeights(path, num_heads=4, num_kv_heads=2) as weights:
        seen: set[str] = set()
        for name in weights.quantized_names():
            quant = weights.quantized(name)
            if not isinstance(quant, KQuantWeight):
                continue
            seen.update(quant.types)
            expected = weights.get(name)  # gguf-py's dequantizer, Q/K rows in HF order
            assert torch.equal(quant.reference_dequantize(), expected), name
            assert torch.equal(quant.dequantize(), expected), name  # the kernel's, if loaded
            if cpu_kernels.load():
                codes = [12 if t == "Q4_K" else 13 if t == "Q5_K" else 14 for t in quant.types]
                decoded = torch.ops.genserve.kquant_dequantize(
                    quant.data, codes, list(quant.row_counts), quant.in_features
                )
                assert torch.equal(decoded, expected), name
    assert seen == ({"Q4_K", "Q6_K"} if preset == "Q4_K_M" else {"Q5_K", "Q6_K"})


def test_rows_columns_and_padding_keep_the_values(mixed: KQuantWeight) -> None:
    w = _gguf_py(mixed)
    assert torch.equal(mixed.dequantize(), w)
    index = torch.tensor([70, 3, 41, 39, 64, 5, 72])  # across all three segments, out of order
    picked = mixed.rows(index)
    assert torch.equal(picked.dequantize(), w[index])
    assert torch.equal(mixed.rows(slice(30, 50)).dequantize(), w[30:50])
    assert torch.equal(mixed.columns(256, 512).dequantize(), w[:, 256:512])
    assert torch.equal(mixed.dequantize_rows(torch.tensor([2, 60]), torch.float32), w[[2, 60]])
    single = _matrix("Q6_K", 10, 256, 5)  # one segment: a plain gather of rows
    assert torch.equal(
        single.rows(torch.tensor([3, 1, 3])).dequantize(), _gguf_py(single)[[3, 1, 3]]
    )
    assert single.rows(torch.tensor(4)).row_counts == (1,)
    padded = cat_any([mixed, zero_rows(mixed, 3)])
    assert isinstance(padded, KQuantWeight)
    assert padded.types == ("Q4_K", "Q6_K", "Q5_K") and padded.row_counts == (40, 24, 12)
    assert not padded.dequantize()[-3:].any()
    with pytest.raises(QuantizationError, match="super-blocks"):
        mixed.columns(128, 512)
    with pytest.raises(QuantizationError, match="mix"):
        cat_any([mixed, quantize_int4(torch.randn(4, 512))])
    with pytest.raises(QuantizationError, match="256"):
        KQuantWeight(torch.zeros(144, dtype=torch.uint8), ("Q4_K",), (1,), 128)
    with pytest.raises(QuantizationError, match="bytes"):
        KQuantWeight(torch.zeros(100, dtype=torch.uint8), ("Q4_K",), (1,), 256)


# ---------------------------------------------------------------------------- kernels
def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.double().abs() @ w.double().abs().T


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, 33])
def test_float_path_equals_a_float64_product_of_the_dequantized_weights(
    mixed: KQuantWeight, m: int
) -> None:
    torch.manual_seed(m)
    w = _gguf_py(mixed)
    x = torch.randn(m, mixed.in_features)
    bias = torch.randn(mixed.out_features)
    got = mixed.serving(FLOAT_PATH).linear(x, bias)
    expected = x.double() @ w.double().T + bias.double()
    assert got.dtype == torch.float32 and got.shape == (m, mixed.out_features)
    assert ((got.double() - expected).abs() <= 2e-6 * _bound(x, w) + 1e-6).all()
    # bfloat16 activations are widened exactly; the output comes back in bfloat16
    xb = x.bfloat16()
    got_b = mixed.serving(FLOAT_PATH).linear(xb, None)
    assert got_b.dtype == torch.bfloat16
    ref_b = xb.double() @ w.double().T
    assert torch.allclose(got_b.double(), ref_b, rtol=1e-2, atol=1e-2 * ref_b.abs().max().item())


def _int_isas() -> list[Isa]:
    return int_dot.available_isas() if cpu_kernels.load() else []


@needs_kernels
@pytest.mark.parametrize("isa", list(Isa)[1:], ids=lambda i: i.name)
@pytest.mark.parametrize("m", [1, 8, 33])
def test_integer_paths_equal_a_float64_product_of_the_same_int8_activations(
    mixed: KQuantWeight, isa: Isa, m: int
) -> None:
    if isa not in _int_isas():
        pytest.skip(f"this CPU has no {isa.name} path")
    torch.manual_seed(10 + m)
    w = _gguf_py(mixed)
    x = torch.randn(m, mixed.in_features) * torch.rand(m, 1) * 4
    q, d, sums = torch.ops.genserve.kquant_quantize(x)
    xq = (q.double().view(m, -1, 256) * d.double()[..., None]).view(m, -1)
    got = mixed.serving(int(isa)).linear(x, None)
    expected = xq @ w.double().T
    assert ((got.double() - expected).abs() <= 2e-6 * _bound(xq, w) + 1e-6).all()
    # Σq per 16 inputs, as the min term uses it
    assert torch.equal(sums.long(), q.long().view(m, -1, 16).sum(-1))


@needs_kernels
@pytest.mark.parametrize("isa", list(Isa)[1:], ids=lambda i: i.name)
@pytest.mark.parametrize("m", [1, 8, 33])
def test_integer_paths_take_bfloat16_as_its_float32_widening(
    mixed: KQuantWeight, isa: Isa, m: int
) -> None:
    """A bfloat16 x is quantized as it is and the output rounded as it is stored: the same
    bits as widening x to float32 and rounding the float32 output, bias included."""
    if isa not in _int_isas():
        pytest.skip(f"this CPU has no {isa.name} path")
    torch.manual_seed(20 + m)
    xb = (torch.randn(m, mixed.in_features) * 3).bfloat16()
    bias = torch.randn(mixed.out_features)
    layer = mixed.serving(int(isa))
    for b in (None, bias):
        got = layer.linear(xb, b)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, layer.linear(xb.float(), b).bfloat16())


@needs_kernels
def test_activation_quantizer_is_llama_cpp_q8_k() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 768) * 3
    x[1, :256] = 0  # an all-zero block: scale 0, quants 0
    q, d, _ = torch.ops.genserve.kquant_quantize(x)
    blocks = x.view(5, 3, 256)
    scale = blocks.abs().amax(-1) / 127
    assert torch.equal(d, scale)
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    expected = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    assert torch.equal(q, expected.view(5, 768))


@needs_kernels
@pytest.mark.parametrize("path", [FLOAT_PATH, int(Isa.AUTO)], ids=["float", "int"])
def test_each_row_is_batch_and_thread_invariant(mixed: KQuantWeight, path: int) -> None:
    if path != FLOAT_PATH and not _int_isas():
        pytest.skip("no integer path on this CPU")
    torch.manual_seed(4)
    x = torch.randn(9, mixed.in_features)
    served = mixed.serving(path)
    batched = served.linear(x, None)
    single = torch.cat([served.linear(x[i : i + 1], None) for i in range(9)])
    assert torch.equal(batched, single)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = served.linear(x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batched, one)


@pytest.fixture(scope="module")
def long_rows() -> KQuantWeight:
    """Rows past the 256-bit paths' 4096-input limit for their several-weight-rows pass, so
    one-row steps take their one-weight-row pass."""
    parts = [_matrix("Q4_K", 6, 4352, 5), _matrix("Q6_K", 5, 4352, 6), _matrix("Q5_K", 3, 4352, 7)]
    return cat_kquant(parts)


@needs_kernels
@pytest.mark.parametrize("isa", [Isa.AVX2, Isa.AVX_VNNI, Isa.VNNI256_EVEX], ids=lambda i: i.name)
@pytest.mark.parametrize("shape", ["short", "long"])
def test_256_bit_paths_are_batch_invariant_and_agree(
    mixed: KQuantWeight, long_rows: KQuantWeight, isa: Isa, shape: str
) -> None:
    """A one-row step (kquant_ymm_row.inc: quants unpacked in registers, 4 or 1 weight rows
    per pass) gives each row exactly what a batched step (kquant_int_row.inc) gives it, and
    every 256-bit path the same bits (the same exact integer lanes, the same float steps)."""
    if isa not in _int_isas():
        pytest.skip(f"this CPU has no {isa.name} path")
    w = mixed if shape == "short" else long_rows
    torch.manual_seed(7)
    x = torch.randn(5, w.in_features) * torch.rand(5, 1) * 4
    served = w.serving(int(isa))
    batched = served.linear(x, None)
    single = torch.cat([served.linear(x[i : i + 1], None) for i in range(5)])
    assert torch.equal(batched, single)
    q, d, _ = torch.ops.genserve.kquant_quantize(x)
    xq = (q.double().view(5, -1, 256) * d.double()[..., None]).view(5, -1)
    ref = _gguf_py(w).double()
    assert ((single.double() - xq @ ref.T).abs() <= 2e-6 * _bound(xq, ref) + 1e-6).all()
    avx2 = w.serving(int(Isa.AVX2))
    assert torch.equal(single, torch.cat([avx2.linear(x[i : i + 1], None) for i in range(5)]))


@needs_kernels
@pytest.mark.parametrize("shape", ["short", "long", "q6_k_only"])
def test_avx512_vnni_path_is_batch_invariant(
    mixed: KQuantWeight, long_rows: KQuantWeight, shape: str
) -> None:
    """kquant_zmm_row.inc: a one-row step (four weight rows a pass at K <= 4,096, one past it)
    gives each row exactly what a batched step (8 activation rows a pass, then a 3-row tail)
    gives it, with the Q4_K / Q5_K activations in nibble order (reordered once per call) and
    Q6_K's as quantized (a Q6_K-only matrix reorders nothing); each within the float64 bound."""
    if Isa.AVX512_VNNI not in _int_isas():
        pytest.skip("this CPU has no AVX512-VNNI path")
    w = {"short": mixed, "long": long_rows, "q6_k_only": _matrix("Q6_K", 7, 768, 8)}[shape]
    torch.manual_seed(9)
    x = torch.randn(11, w.in_features) * torch.rand(11, 1) * 4
    served = w.serving(int(Isa.AVX512_VNNI))
    batched = served.linear(x, None)
    assert torch.equal(batched, torch.cat([served.linear(x[i : i + 1], None) for i in range(11)]))
    q, d, _ = torch.ops.genserve.kquant_quantize(x)
    xq = (q.double().view(11, -1, 256) * d.double()[..., None]).view(11, -1)
    ref = _gguf_py(w).double()
    assert ((batched.double() - xq @ ref.T).abs() <= 2e-6 * _bound(xq, ref) + 1e-6).all()


@needs_kernels
def test_bad_inputs_are_refused(mixed: KQuantWeight) -> None:
    op = torch.ops.genserve.kquant_linear
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        op(torch.randn(2, 300), mixed.data, [12], [1], None, -1)
    with pytest.raises(RuntimeError, match="bytes"):
        op(x, mixed.data[:-1].contiguous(), [12, 14, 13], [40, 24, 9], None, -1)
    with pytest.raises(RuntimeError, match="Q4_K"):
        op(x, mixed.data, [8], [73], None, -1)
    with pytest.raises(RuntimeError, match="bias"):
        op(x, mixed.data, [12, 14, 13], [40, 24, 9], torch.zeros(3), -1)
    with pytest.raises(RuntimeError, match="integer path"):
        op(x, mixed.data, [12, 14, 13], [40, 24, 9], None, 99)
