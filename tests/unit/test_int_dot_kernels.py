"""genserve's integer dot-product matmul (``genserve::int_dot_linear``, ``--cpu-int-dot``)
against a float64 product of the *same* int8 activations and quantized weights, on every
instruction-set path this CPU runs (the others skip, saying which the CPU lacks), and its
packing, its mode choice and its place in the fused decode layer."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from genserve.bench.int_dot_speed import q4_0, q8_0
from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.kernels.int_dot import IntDotUnavailableError, Isa
from genserve.model.int_dot_panels import IntDotPanels, _block_params
from genserve.model.quantization import QuantizedWeight, quantize_int4, quantize_int8
from tests.conftest import TinyModelFactory

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")

PATHS = [Isa.AVX2, Isa.AVX_VNNI, Isa.AVX512_VNNI, Isa.VNNI256_EVEX]
FORMATS = {
    "Q8_0": q8_0,
    "int8 per-channel": quantize_int8,
    "Q4_0": q4_0,
    "Q4_1 (int4)": quantize_int4,
}
ROWS = (1, 3, 8, 32, 70)  # 70: past one task's 64-row block


def _require(isa: Isa) -> None:
    if isa not in int_dot.available_isas():
        pytest.skip(f"this CPU lacks the {isa.name} path (has {int_dot.available_isas()})")


def _weight_values(quant: QuantizedWeight) -> torch.Tensor:
    """``scale * q (+ min)`` per weight in float64 (exact: small integers, float16 params)."""
    n, k = quant.out_features, quant.in_features
    if quant.bits == 8:
        q = quant.data.to(torch.float64)
    else:
        low, high = (quant.data & 0x0F).view(n, k // 32, 16), (quant.data >> 4).view(n, k // 32, 16)
        q = torch.cat((low, high), dim=-1).reshape(n, k).to(torch.float64)
    per_k = torch.arange(k) // quant.group
    w = q * quant.scales.to(torch.float64)[:, per_k]
    if quant.mins is not None:
        w = w + quant.mins.to(torch.float64)[:, per_k]
    return w


def _reference(x: torch.Tensor, quant: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product of the kernel's own int8 activations and the weights, and the
    same product of absolute values (the scale of float32 rounding error)."""
    q, d, _ = torch.ops.genserve.int_dot_quantize(x)
    k = x.shape[1]
    xs = q.to(torch.float64).view(q.shape[0], -1, 32) * d.to(torch.float64)[..., None]
    xs = xs.reshape(q.shape[0], -1)[:, :k]
    w = _weight_values(quant)
    return xs @ w.T, xs.abs() @ w.abs().T


@pytest.fixture
def restore_mode() -> Iterator[None]:
    saved = int_dot.mode()
    yield
    int_dot.configure(saved)


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: i.name)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize(("k", "n"), [(96, 40), (2080, 33)])  # 2080: 8 x 256 + 32
def test_kernel_matches_float64_product_of_the_same_quantized_values(
    isa: Isa, fmt: str, k: int, n: int
) -> None:
    _require(isa)
    gen = torch.Generator().manual_seed(k + n)
    quant = FORMATS[fmt](torch.randn(n, k, generator=gen))
    panels = IntDotPanels.pack(quant)
    for rows in ROWS:
        x = torch.randn(rows, k, generator=gen) * 3
        exact, scale = _reference(x, quant)
        got = panels.linear(x, None, isa).to(torch.float64)
        # float32 products of exact int32 sums and float32 scales, summed per block.
        assert (got - exact).abs().le(2e-6 * scale + 1e-30).all(), f"{rows} rows"


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: i.name)
def test_per_channel_int8_with_input_features_not_a_multiple_of_32(isa: Isa) -> None:
    _require(isa)
    gen = torch.Generator().manual_seed(3)
    quant = quantize_int8(torch.randn(50, 100, generator=gen))
    x = torch.randn(5, 100, generator=gen)
    exact, scale = _reference(x, quant)
    got = IntDotPanels.pack(quant).linear(x, None, isa).to(torch.float64)
    assert (got - exact).abs().le(2e-6 * scale).all()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1 (int4)"])
def test_threads_bias_and_bfloat16_do_not_change_the_sums(fmt: str) -> None:
    gen = torch.Generator().manual_seed(5)
    quant = FORMATS[fmt](torch.randn(200, 512, generator=gen))
    panels = IntDotPanels.pack(quant)
    x = torch.randn(9, 512, generator=gen)
    bias = torch.randn(200, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = panels.linear(x, None)
        torch.set_num_threads(max(2, threads))
        many = panels.linear(x, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # one task per panel: the order of sums never changes
    assert torch.equal(panels.linear(x, bias), one + bias)
    # bfloat16 x is quantized as it is and the output rounded as it is stored, on every path
    half = x.to(torch.bfloat16)
    for isa in int_dot.available_isas():
        for b in (None, bias):
            got = panels.linear(half, b, isa)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, panels.linear(half.float(), b, isa).bfloat16())


def test_activations_are_rounded_per_block_of_32_like_llama_cpp_q8_0() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 80, generator=gen) * 10
    x[1, 32:64] = 0  # an all-zero block: scale 0, values 0
    q, d, sums = torch.ops.genserve.int_dot_quantize(x)
    assert q.shape == (3, 96) and q.dtype == torch.int8
    padded = torch.nn.functional.pad(x, (0, 16)).view(3, 3, 32)
    amax = padded.abs().amax(-1)
    assert torch.equal(d, amax / 127)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    expected = torch.round(padded * inv[..., None]).clamp(-127, 127).to(torch.int8)  # ties even
    assert torch.equal(q.view(3, 3, 32), expected)
    assert torch.equal(sums, expected.to(torch.int32).sum(-1))
    assert torch.equal(q[:, 80:], torch.zeros(3, 16, dtype=torch.int8))


def test_whole_and_partial_blocks_quantize_alike_ties_and_nan_included() -> None:
    # A whole block of 32 takes the vector quantizer, a last partial block the scalar loop:
    # the same 16 values (ties at .5, a NaN, an infinity-free max) padded with zeros in both
    # give the same bytes, scale and sum.
    values = torch.tensor([127.0, 2.5, -2.5, 3.5, -0.5, 0.5, 1.5, -126.5])
    values = torch.cat([values, values / 3])
    x = torch.zeros(2, 48)
    x[:, :16] = values
    x[:, 32:48] = values
    x[1, 5] = x[1, 37] = float("nan")
    q, d, sums = torch.ops.genserve.int_dot_quantize(x)
    assert torch.equal(q[:, :16], q[:, 32:48]) and torch.equal(d[:, 0], d[:, 1])
    assert torch.equal(sums[:, 0], sums[:, 1])
    assert q[0, :8].tolist() == [127, 2, -2, 4, 0, 0, 2, -126]  # ties to even
    assert q[1, 5] == -127  # NaN clamps to -127 on both paths


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_packing_keeps_the_weights_exactly(fmt: str) -> None:
    gen = torch.Generator().manual_seed(11)
    quant = FORMATS[fmt](torch.randn(70, 128, generator=gen))
    panels = IntDotPanels.pack(quant)
    ids = torch.tensor([0, 31, 32, 47, 69])  # both nibbles, both panels, the padded last one
    assert torch.equal(panels.dequantize_rows(ids, torch.float32), quant.dequantize()[ids])
    assert torch.equal(panels.dequantize_rows(torch.arange(70), torch.float32), quant.dequantize())


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("shape", [(64, 128), (70, 96), (33, 40)])
def test_packing_pads_with_zero_weights_and_owns_its_bytes(
    fmt: str, shape: tuple[int, int]
) -> None:
    """Padded rows and inputs hold integer 0 (byte 128 at 8 bits, nibble 0 at 4), and the
    panels never alias the stored form, also where no padding is needed (packing then
    reads straight from it: issue #28's start-up work)."""
    n, k = shape
    if k % 32 and fmt != "int8 per-channel":
        pytest.skip("block formats have whole blocks of 32 inputs")
    gen = torch.Generator().manual_seed(5)
    quant = FORMATS[fmt](torch.randn(n, k, generator=gen))
    panels = IntDotPanels.pack(quant)
    values = panels.quantized_values()  # [N, K] of the unpadded matrix
    p, kp = panels.data.shape[0], panels.data.shape[1] * 4
    padded = IntDotPanels(panels.data, panels.scales, panels.mins, panels.bits, kp, p * 32)
    whole = padded.quantized_values()
    assert torch.equal(whole[:n, :k], values)
    assert bool((whole[n:] == 0).all()) and bool((whole[:, k:] == 0).all())
    stored = {quant.data.untyped_storage().data_ptr(), quant.scales.untyped_storage().data_ptr()}
    mine = [panels.data, panels.scales] + ([] if panels.mins is None else [panels.mins])
    assert not stored & {t.untyped_storage().data_ptr() for t in mine}


def test_kernel_rejects_what_it_does_not_serve() -> None:
    quant = q4_0(torch.randn(40, 64))
    panels = IntDotPanels.pack(quant)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="K / 32"):
        torch.ops.genserve.int_dot_linear(
            torch.randn(2, 96), panels.data, panels.scales, panels.mins, 4, 40, None, 0
        )
    eight = IntDotPanels.pack(q8_0(torch.randn(40, 64)))
    with pytest.raises(RuntimeError, match="take no mins"):
        torch.ops.genserve.int_dot_linear(x, eight.data, eight.scales, eight.scales, 8, 40, None, 0)
    with pytest.raises(RuntimeError, match="disagree"):
        torch.ops.genserve.int_dot_linear(
            x, panels.data, panels.scales, panels.mins, 4, 70, None, 0
        )
    missing = [i for i in PATHS if i not in int_dot.available_isas()]
    if missing:
        with pytest.raises(RuntimeError, match="lacks"):
            panels.linear(x, None, missing[0])


def test_mode_choice(restore_mode: None) -> None:
    int_dot.configure("off")
    assert not int_dot.active()
    int_dot.configure("auto")
    best = int_dot.available_isas()[-1]
    assert int_dot.choose().isa == best and int_dot.active()
    assert int_dot.choose("on").enabled
    with pytest.raises(ValueError, match="not one of"):
        int_dot.configure("yes")  # type: ignore[arg-type]
    # float16 activations: the kernels take float32 or bfloat16, so auto keeps the float path
    # (with the reason) and on is refused, rather than failing in the first step.
    int_dot.configure("auto", "float16")
    assert not int_dot.active() and "float16" in int_dot.choose().reason
    with pytest.raises(IntDotUnavailableError, match="float16"):
        int_dot.choose("on")
    int_dot.configure("auto", "bfloat16")
    assert int_dot.active()
    saved = cpu_kernels._settings.enabled
    cpu_kernels.configure(enabled=False)
    try:
        with pytest.raises(IntDotUnavailableError, match="--cpu-int-dot on"):
            int_dot.choose("on")
        assert not int_dot.choose("auto").enabled
    finally:
        cpu_kernels.configure(enabled=saved)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_decode_layer_op_runs_int_dot_projections_like_the_layers(
    tiny_model_factory: TinyModelFactory, quantize: str, restore_mode: None
) -> None:
    """With ``--cpu-int-dot on`` the fused decode layer runs the projections through the
    integer kernel (the down projection adding into the residual as it stores), bit-identical
    to the layer-by-layer step; and the logits stay close to the float path's."""
    from genserve.model.attention import SeqSpec, TorchPagedAttention
    from genserve.model.config import load_model_config
    from genserve.model.quantize_model import quantize_model
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    model_dir = tiny_model_factory("qwen2")  # Q/K/V biases
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    backend = TorchPagedAttention(cpu, use_cpu_kernel=True)
    lens, tables = (37, 5, 20), [(4, 2, 6), (9,), (11, 12)]
    decodes = [SeqSpec(1, n, t) for n, t in zip(lens, tables, strict=True)]
    tokens, positions = torch.tensor([7, 100, 3]), torch.tensor(lens)

    def build(mode: int_dot.IntDotMode) -> torch.nn.Module:
        int_dot.configure(mode)
        model = build_model(config, ParallelContext.single(), torch.float32, cpu)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        quantize_model(model, quantize)
        model.use_fused_cpu_ops(matvec_rows=32)
        assert model._decode_layers_fused
        return model

    with torch.inference_mode():
        shape = backend.kv_cache_shape(16, 16, config.num_kv_heads, config.head_dim)
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn(shape, generator=gen) for _ in range(config.num_layers)]

        def step(model: torch.nn.Module, fused: bool) -> torch.Tensor:
            model._decode_layers_fused = fused
            kv = [c.clone() for c in caches]
            hidden = model(tokens, positions, kv, backend.build(decodes, len(decodes), 16))
            return model.compute_logits(hidden)

        model = build("on")
        assert any(isinstance(getattr(m, "qpanels", None), IntDotPanels) for m in model.modules())
        fused, plain = step(model, True), step(model, False)
        float_path = step(build("off"), True)
    assert torch.equal(fused, plain)
    # int8 activations move the logits by about their rounding: ~1% of their norm here.
    drift = (fused - float_path).norm() / float_path.norm()
    print(f"int-dot vs float path, relative logit drift {drift:.4f}")
    assert drift < 0.05


def _with_stored_mins(panels: IntDotPanels, quant: QuantizedWeight) -> IntDotPanels:
    """The same panels with Q4_0's mins (-8 d) stored, as they were packed before."""
    assert quant.mins is not None
    n_pad, blocks = panels.data.shape[0] * 32, panels.scales.shape[1]
    mins = _block_params(quant.mins, quant.group, quant.in_features, n_pad, blocks)
    return dataclasses.replace(panels, mins=mins)


@pytest.mark.parametrize("isa", PATHS, ids=lambda i: i.name)
def test_q4_0_keeps_no_mins_and_gives_the_same_bits(isa: Isa) -> None:
    """Q4_0's mins are -8 d: packed without them (18 bytes per 32 weights streamed, not 20),
    the kernels compute them from the scales, bit for bit what the stored mins gave."""
    _require(isa)
    gen = torch.Generator().manual_seed(13)
    quant = q4_0(torch.randn(70, 2080, generator=gen))
    quant.scales[3, 5] = 0  # a zero block: its min is -0.0 either way
    quant.mins[3, 5] = quant.scales[3, 5] * -8
    panels = IntDotPanels.pack(quant)
    assert panels.mins is None
    assert panels.nbytes == panels.data.nbytes + panels.scales.nbytes
    stored = _with_stored_mins(panels, quant)
    for rows in ROWS:
        x = torch.randn(rows, 2080, generator=gen)
        assert torch.equal(panels.linear(x, None, isa), stored.linear(x, None, isa)), rows
    # a Q4_1 weight whose mins are not -8 d keeps them
    assert IntDotPanels.pack(quantize_int4(torch.randn(40, 64, generator=gen))).mins is not None


def test_q4_0_without_mins_in_the_bf16_gemm_and_the_decode_layer() -> None:
    """The other readers of the layout: the bfloat16 prefill GEMM decodes the same weights
    (m = -8 d), and the one-op decode layer passes no mins through to the kernel."""
    gen = torch.Generator().manual_seed(17)
    quant = q4_0(torch.randn(64, 256, generator=gen))
    panels = IntDotPanels.pack(quant)
    stored = _with_stored_mins(panels, quant)
    x = torch.randn(5, 256, generator=gen)
    try:
        got = torch.ops.genserve.int_dot_linear_bf16(
            x, panels.data, panels.scales, None, 4, 64, None, 0
        )
    except RuntimeError as exc:  # no AVX-512 decode on this CPU
        pytest.skip(str(exc))
    want = torch.ops.genserve.int_dot_linear_bf16(
        x, stored.data, stored.scales, stored.mins, 4, 64, None, 0
    )
    assert torch.equal(got, want)


def test_large_inputs_quantize_into_their_own_buffers() -> None:
    """Up to 1 MiB of quantized activations reuse the calling thread's buffers, larger inputs
    (prefill) get their own; either way each row's result is the same."""
    if not int_dot.available_isas():
        pytest.skip("no integer dot-product path on this CPU")
    gen = torch.Generator().manual_seed(11)
    panels = IntDotPanels.pack(q8_0(torch.randn(64, 2048, generator=gen)))
    x = torch.randn(600, 2048, generator=gen).bfloat16()  # 1.2 MiB of int8 activations
    big = panels.linear(x, None)
    for rows in (slice(0, 1), slice(598, 600), slice(0, 600)):
        assert torch.equal(panels.linear(x[rows], None), big[rows])
