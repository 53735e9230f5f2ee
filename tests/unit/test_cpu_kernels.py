"""genserve's C++ paged decode attention against a float64 reference computed from the same
block pool, and the attention backend's use of it (with the torch path as the fallback)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.attention_backend import select_backend
from genserve.testing.tiny_model import NATIVE_FAMILIES
from tests.conftest import TinyModelFactory

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
    ("num_heads", "num_kv_heads", "head_dim"),
    # Groups of 3, 1 and 9 query heads: fewer, as many and more than one pass over a block's
    # values sums at once (4 heads of 64, 2 of 128 with AVX-512); 40 takes the staged path.
    [(9, 3, 64), (4, 4, 128), (18, 2, 64), (6, 2, 40)],
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
    # Queries that are the first heads of a wider tensor (decode_layer's rotated Q + K heads)
    # are read in place, with the same result.
    wider = torch.cat([q, torch.randn_like(q[:, :2])], dim=1)[:, : q.shape[1]]
    assert not wider.is_contiguous()
    in_place = torch.ops.genserve.paged_decode_attention(
        wider, cache, table, lengths, scale, -1 if window is None else window
    )
    assert torch.equal(in_place, out)


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


def test_backend_uses_the_kernel_for_cpu_decodes() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.bfloat16, torch.float32):
        assert select_backend(cpu, BLOCK_SIZE, dtype).name.endswith("cpu-decode-kernel")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_fused_ops_round_like_the_torch_ops(dtype: torch.dtype, num_tokens: int) -> None:
    """Each fused op against the torch ops it replaces in the model (same roundings)."""
    from genserve.model.config import RopeConfig
    from genserve.model.rotary import RotaryEmbedding, apply_rotary

    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 576, generator=gen).to(dtype)
    residual = torch.randn(num_tokens, 576, generator=gen).to(dtype)
    weight = torch.randn(576, generator=gen).to(dtype)
    ops = torch.ops.genserve

    expected_norm = weight * torch.nn.functional.rms_norm(x.float(), (576,), eps=1e-5).to(dtype)
    # The float32 sum of squares may be ordered differently: allow a last-bit difference.
    last_bit = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), expected_norm, atol=0, rtol=last_bit)
    summed, normed = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, residual + x)
    torch.testing.assert_close(normed, ops.rms_norm(residual + x, weight, 1e-5), atol=0, rtol=0)

    gate_up = (3 * torch.randn(num_tokens, 2 * 1536, generator=gen)).to(dtype)
    expected_act = torch.nn.functional.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    actual_act = ops.silu_and_mul(gate_up)
    # exp is a polynomial here, libm's there: a value on a rounding boundary may differ (in
    # float32, without a rounding to half precision to absorb it, in the last bit or two).
    if dtype != torch.float32:
        assert (actual_act != expected_act).float().mean().item() < 1e-3
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(actual_act, expected_act, atol=tolerance, rtol=tolerance)

    rope = RopeConfig(theta=10000.0, rope_type="default", params={})
    cos, sin = RotaryEmbedding(rope, 64, torch.device("cpu")).cos_sin(
        torch.arange(num_tokens) * 7, dtype
    )
    qk = torch.randn(num_tokens, 12, 64, generator=gen).to(dtype)
    assert torch.equal(ops.rotary(qk, cos, sin), apply_rotary(qk, cos, sin))
    # A strided view (Q and K heads sliced out of the fused QKV output) works too.
    qkv = torch.randn(num_tokens, 15 * 64, generator=gen).to(dtype)
    view = qkv[:, : 12 * 64].view(num_tokens, 12, 64)
    assert torch.equal(ops.rotary(view, cos, sin), apply_rotary(view, cos, sin))


def test_fused_ops_reject_other_dtypes() -> None:
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        torch.ops.genserve.rms_norm(torch.ones(2, 4, dtype=torch.float64), torch.ones(4), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 32, 35])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (7, 1536), (33, 100)])
def test_matvec_matches_a_float64_product(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int
) -> None:
    """The weight-streaming matvec against float64: float32 accumulation whatever the
    storage, odd sizes (tails shorter than a vector, fewer rows than a block, more rows than
    the registers hold, so chunked), with bias."""
    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    expected = x.double() @ weight.double().t() + bias.double()
    actual = torch.ops.genserve.matvec(x, weight, bias)
    assert actual.dtype == dtype and actual.shape == (rows, out_features)
    # float32: the rounding of a float32 sum of up to 1536 products (~1e-4 on sums of ~40,
    # as torch's own F.linear); half precision: one rounding of the output.
    atol, rtol = (1e-4, 1e-5) if dtype == torch.float32 else (8e-3, 8e-3)
    torch.testing.assert_close(actual.double(), expected, atol=atol, rtol=rtol)
    no_bias = torch.ops.genserve.matvec(x, weight, None)
    torch.testing.assert_close(no_bias.double(), expected - bias.double(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 32])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (37, 100), (5, 31)])
def test_matvec_bf16_by_dot_products_agrees_with_the_fma_path(
    rows: int, out_features: int, in_features: int
) -> None:
    """bf16 x bf16 takes VDPBF16PS where the CPU has AVX512-BF16 (the float-FMA path where it
    has not): the same exact products summed in another order, so both are within one bf16
    rounding of the float64 product and of each other.  A float32 x of bf16 values (the LM
    head's) takes the same kernel with its float32 sums unrounded; any other float32 x stays
    on the FMA path."""
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    expected = x.double() @ weight.double().t()
    fast = torch.ops.genserve.matvec(x, weight, None)
    fma = torch.ops.genserve.matvec_fma(x, weight, None)
    torch.testing.assert_close(fast.double(), expected, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(fast, fma, atol=8e-3, rtol=8e-3)
    x32 = x.float()
    logits = torch.ops.genserve.matvec(x32, weight, None)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), expected, atol=1e-3, rtol=1e-4)
    # The same sums as the bf16 x's, before its one rounding.
    assert torch.equal(logits.to(torch.bfloat16), fast)
    off_grid = x32 + 1e-3  # not bf16 values: the float path, as matvec_fma
    assert torch.equal(
        torch.ops.genserve.matvec(off_grid, weight, None),
        torch.ops.genserve.matvec_fma(off_grid, weight, None),
    )


def test_matvec_rejects_what_it_does_not_serve() -> None:
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        torch.ops.genserve.matvec(torch.ones(1, 4), torch.ones(3, 5), None)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 weight"):
        torch.ops.genserve.matvec(torch.ones(1, 4), torch.ones(3, 4, dtype=torch.float64), None)


@pytest.mark.parametrize("rows", [1, 2, 11, 12, 13, 25, 32, 129, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (7, 1536), (33, 100)])
def test_panel_linear_matches_a_float64_product(
    rows: int, out_features: int, in_features: int
) -> None:
    """float32 weights in 32-column panels against float64: one streamed row, tiles of 12
    (AVX-512; 3 with AVX2) with remainders, more than one 128-row block, panels with unused
    columns (7, 33 outputs), k-chunks of 128 with a short last one (100, 1536 inputs)."""
    from genserve.model.weight_panels import float_panel_rows, pack_float

    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    panels = pack_float(weight)
    assert panels.shape == (-(-out_features // 32), in_features, 32)
    assert torch.equal(float_panel_rows(panels, torch.arange(out_features)), weight)
    expected = x.double() @ weight.double().t() + bias.double()
    actual = torch.ops.genserve.panel_linear(x, panels, out_features, bias)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out_features)
    torch.testing.assert_close(actual.double(), expected, atol=1e-4, rtol=1e-5)
    no_bias = torch.ops.genserve.panel_linear(x, panels, out_features, None)
    torch.testing.assert_close(no_bias.double(), expected - bias.double(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 10, 11, 13, 32, 33, 129, 257, 300])
@pytest.mark.parametrize(("out_features", "in_features"), [(960, 576), (7, 1536), (33, 100)])
def test_float16_panels_give_the_float32_panels_results_bit_for_bit(
    rows: int, out_features: int, in_features: int
) -> None:
    """A float32 weight whose values are all float16 values (an F16 GGUF served in float32)
    packed as float16 panels: every path (one streamed row, row tiles with remainders, more
    than one row block; on x86 the tiles' own widening and the k-major copy of x up to 32
    rows) gives exactly the float32 panels' results, with and without bias, and the rows look
    up exactly.  Float16 panels stay on the row tiles past 256 rows, where float32 panels
    take torch's GEMM, so the float32 results are taken 128 rows (one row block) at a time:
    the panel loop computes each row block alone.  Run with the native library and the
    AVX2-level one (``ATEN_CPU_CAPABILITY=avx2``) to cover both builds."""
    from genserve.model.weight_panels import float_panel_rows, pack_float, pack_half_exact

    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen).half().float()
    bias = torch.randn(out_features, generator=gen)
    half = pack_half_exact(weight)
    assert half is not None and half.dtype == torch.float16
    assert half.shape == (-(-out_features // 32), in_features, 32)
    looked_up = float_panel_rows(half, torch.arange(out_features))
    assert looked_up.dtype == torch.float32 and torch.equal(looked_up, weight)
    full = pack_float(weight)
    for b in (bias, None):
        blocks = [
            torch.ops.genserve.panel_linear(x[i : i + 128], full, out_features, b)
            for i in range(0, rows, 128)
        ]
        expected = torch.cat(blocks)
        actual = torch.ops.genserve.panel_linear(x, half, out_features, b)
        assert actual.dtype == torch.float32 and torch.equal(actual, expected)
    reference = x.double() @ weight.double().t() + bias.double()
    actual = torch.ops.genserve.panel_linear(x, half, out_features, bias)
    torch.testing.assert_close(actual.double(), reference, atol=1e-4, rtol=1e-5)


def test_only_float16_valued_weights_get_float16_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    from genserve.model import weight_panels

    exact = torch.randn(40, 64).half().float()
    assert weight_panels.is_exact_half(exact)
    assert weight_panels.pack_half_exact(exact) is not None
    for inexact in (
        torch.randn(40, 64),  # float32 values
        torch.cat([exact[:39], torch.full((1, 64), 1e-6)]),  # below float16's range: last row
        torch.cat([exact[:39], torch.full((1, 64), 1e5)]),  # above it
        exact.to(torch.bfloat16),  # not float32
    ):
        assert weight_panels.pack_half_exact(inexact) is None
    assert weight_panels.half_panels_enabled()
    monkeypatch.setenv(weight_panels.ENV_HALF_PANELS, "0")
    assert not weight_panels.half_panels_enabled()


def test_panel_linear_rejects_what_it_does_not_serve() -> None:
    from genserve.model.weight_panels import pack_float

    panels = pack_float(torch.ones(40, 8))
    with pytest.raises(RuntimeError, match="panels"):
        torch.ops.genserve.panel_linear(torch.ones(1, 8), panels, 70, None)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.genserve.panel_linear(torch.ones(1, 8, dtype=torch.bfloat16), panels, 40, None)
    with pytest.raises(ValueError, match="float32"):
        pack_float(torch.ones(3, 4, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_model_with_fused_ops_and_kernel_matches_the_torch_path(
    tiny_model_factory: TinyModelFactory, dtype: torch.dtype
) -> None:
    """A tiny Qwen2 (biases, untied head) over a prefill step and a decode step of three
    sequences: the fused ops + decode kernel + matvec projections against the plain torch
    ops."""
    from genserve.model.config import load_model_config
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    model_dir = tiny_model_factory("qwen2")
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen) for n in (37, 5, 20)]
    tables = [(4, 2, 6), (9,), (11, 12)]

    def run(fused: bool) -> torch.Tensor:
        with torch.inference_mode():
            model = build_model(config, ParallelContext.single(), dtype, cpu)
            with SafetensorsWeights(model_dir) as weights:
                model.load_weights(weights)
            if fused:  # as the model runner does: float32 in panels, bf16 streamed by matvec
                model.use_fused_cpu_ops(matvec_rows=4)  # the 3-row decode step, not prefill
            else:
                model.pack_weights()
            backend = TorchPagedAttention(cpu, use_cpu_kernel=fused)
            shape = backend.kv_cache_shape(16, 16, model.num_local_kv_heads, config.head_dim)
            caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
            seqs = [SeqSpec(len(p), 0, t) for p, t in zip(prompts, tables, strict=True)]
            positions = torch.cat([torch.arange(len(p)) for p in prompts])
            model(torch.cat(prompts), positions, caches, backend.build(seqs, 0, 16))
            decodes = [SeqSpec(1, len(p), t) for p, t in zip(prompts, tables, strict=True)]
            step = backend.build(decodes, len(decodes), 16)
            last = torch.tensor([int(p[-1]) for p in prompts])
            hidden = model(last, torch.tensor([len(p) for p in prompts]), caches, step)
            return model.compute_logits(hidden)

    fused, plain = run(True), run(False)
    # bf16 through 2 layers; float32 differs only in the order of sums.
    tolerance = 1e-1 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fused, plain, atol=tolerance, rtol=tolerance / 2)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_reconfiguring_after_load_keeps_the_one_library(tmp_path: Path) -> None:
    """An in-process server with its own --genserve-cache must not load a second library
    (registering the genserve op namespace twice aborts the process); disabling still works."""
    saved = (cpu_kernels._settings.cache_dir, cpu_kernels._settings.enabled)
    try:
        cpu_kernels.configure(tmp_path / "kernels")
        assert cpu_kernels.load()
        assert not (tmp_path / "kernels").exists()  # nothing was built there
        cpu_kernels.configure(enabled=False)
        assert not cpu_kernels.load()
        assert select_backend(torch.device("cpu"), BLOCK_SIZE, torch.bfloat16).name == "torch-sdpa"
    finally:
        cpu_kernels.configure(*saved)
    assert cpu_kernels.load()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_write_kv_equals_rotary_then_write_kv(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, dim, blocks = 5, 6, 2, 16, 8
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    qk_in = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    cos = torch.randn(tokens, 1, dim, generator=gen).to(dtype)
    sin = torch.randn(tokens, 1, dim, generator=gen).to(dtype)
    slots = torch.tensor([3, 77, 16, 40, 127])  # scattered over the blocks
    shape = (2, kv_heads, blocks, BLOCK_SIZE, dim)
    expected_cache = torch.zeros(shape, dtype=dtype)
    expected = torch.ops.genserve.rotary(qk_in, cos, sin)
    # qk_in and v are column slices of qkv, read in place: the same as from contiguous copies.
    assert torch.equal(expected, torch.ops.genserve.rotary(qk_in.contiguous(), cos, sin))
    flat = expected_cache.view(2, kv_heads, blocks * BLOCK_SIZE, dim)
    flat[0].index_copy_(1, slots, expected[:, heads:].transpose(0, 1))
    flat[1].index_copy_(1, slots, v.transpose(0, 1))
    cache = torch.zeros(shape, dtype=dtype)
    got = torch.ops.genserve.rotary_write_kv(qk_in, cos, sin, v, cache, slots)
    assert torch.equal(got, expected) and torch.equal(cache, expected_cache)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.genserve.rotary_write_kv(qk_in, cos, sin, v, cache, slots * 100)


@pytest.mark.parametrize(
    ("dtype", "quantize", "matvec_rows"),
    [
        (torch.float32, None, 32),  # float32 panels
        (torch.float32, "int8", 32),  # quantized panels
        (torch.float32, "int4", 32),
        (torch.bfloat16, None, 32),  # plain bf16 weights through the matvec
        (torch.bfloat16, None, 2),  # ... and through torch's GEMM (3 rows > 2)
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_layer_op_equals_the_layer_by_layer_step(
    tiny_model_factory: TinyModelFactory,
    arch: str,
    dtype: torch.dtype,
    quantize: str | None,
    matvec_rows: int,
) -> None:
    """``genserve::decode_layer`` (one op per layer of a decode-only step) runs the same ops
    as the Python layer, so the hidden states are bit-identical; the KV it writes too.  Qwen2
    adds Q/K/V biases."""
    from genserve.model.config import load_model_config
    from genserve.model.quantize_model import quantize_model
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    model_dir = tiny_model_factory(arch)
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), dtype, cpu)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        if quantize is not None:
            quantize_model(model, quantize)
        model.use_fused_cpu_ops(matvec_rows=matvec_rows)
        assert model._decode_layers_fused
        backend = TorchPagedAttention(cpu, use_cpu_kernel=True)
        shape = backend.kv_cache_shape(16, 16, model.num_local_kv_heads, config.head_dim)
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(config.num_layers)]
        lens = (37, 5, 20)
        tables = [(4, 2, 6), (9,), (11, 12)]
        decodes = [SeqSpec(1, n, t) for n, t in zip(lens, tables, strict=True)]
        tokens = torch.tensor([7, 100, 3])
        positions = torch.tensor(lens)

        stack = model._decode_stack
        assert stack is not None and stack.size() == config.num_layers

        def step(fused: bool, whole_stack: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
            model._decode_layers_fused = fused
            model._decode_stack = stack if whole_stack else None  # decode_layer per layer
            kv = [c.clone() for c in caches]
            hidden = model(tokens, positions, kv, backend.build(decodes, len(decodes), 16))
            return hidden, kv

        (fused_hidden, fused_kv), (plain_hidden, plain_kv) = step(True), step(False)
        layer_hidden, layer_kv = step(True, whole_stack=False)
        assert torch.equal(layer_hidden, plain_hidden)
        assert all(torch.equal(a, b) for a, b in zip(layer_kv, plain_kv, strict=True))
    assert torch.equal(fused_hidden, plain_hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, plain_kv, strict=True))


@pytest.mark.parametrize(
    ("dtype", "matvec_rows"),
    [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 2)],
)
@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_every_native_family_decodes_through_the_fused_layer(
    tiny_model_factory: TinyModelFactory, family: str, dtype: torch.dtype, matvec_rows: int
) -> None:
    """Every native family's decode-only CPU steps take ``genserve::decode_layer`` (q/k
    norms, LayerNorm, post norms, multipliers, parallel blocks, GELU MLPs, soft-capping,
    biases, sliding and no-rope layers), and its hidden states and K/V are bit-identical
    to the per-op path's: the op runs the same ops in the same order.  The context lengths
    cross the tiny families' sliding windows."""
    from genserve.model.causal_lm import DecoderForCausalLM
    from genserve.model.config import load_model_config
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    model_dir = tiny_model_factory(family)
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), dtype, cpu)
        assert isinstance(model, DecoderForCausalLM)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        model.use_fused_cpu_ops(matvec_rows=matvec_rows)
        assert model.decode_layers_fused, f"{family} does not take the fused decode layer"
        backend = TorchPagedAttention(cpu, use_cpu_kernel=True)
        shape = backend.kv_cache_shape(16, 16, model.num_local_kv_heads, config.head_dim)
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(config.num_layers)]
        lens = (57, 5, 40)
        tables = [(4, 2, 6, 13), (9,), (11, 12, 14)]
        decodes = [SeqSpec(1, n, t) for n, t in zip(lens, tables, strict=True)]
        tokens = torch.tensor([7, 100, 3])
        positions = torch.tensor(lens) - 1

        stack = model._decode_stack
        assert stack is not None and stack.size() == config.num_layers

        def step(fused: bool, whole_stack: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
            model._decode_layers_fused = fused
            model._decode_stack = stack if whole_stack else None  # decode_layer per layer
            kv = [c.clone() for c in caches]
            hidden = model(tokens, positions, kv, backend.build(decodes, len(decodes), 16))
            return hidden, kv

        (fused_hidden, fused_kv), (plain_hidden, plain_kv) = step(True), step(False)
        layer_hidden, layer_kv = step(True, whole_stack=False)
        assert torch.equal(layer_hidden, plain_hidden)
        assert all(torch.equal(a, b) for a, b in zip(layer_kv, plain_kv, strict=True))
    assert torch.isfinite(fused_hidden).all()
    assert torch.equal(fused_hidden, plain_hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, plain_kv, strict=True))


def test_decode_attention_soft_cap_matches_the_eager_reference() -> None:
    """The kernel's soft-cap (Gemma 2) equals ``cap * tanh(scores / cap)`` before the
    softmax, on the whole-context and the split-context paths."""
    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, head_dim, blocks = 4, 2, 64, 80
    cache = torch.randn(2, num_kv_heads, blocks, BLOCK_SIZE, head_dim, generator=gen) * 3
    lens = [1100, 30]  # two sequences x two KV heads: the long context is split in parts
    table = torch.tensor([list(range(70)), list(range(70, 72)) + [0] * 68])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen) * 3
    scale, cap = 0.125, 5.0
    out = torch.ops.genserve.paged_decode_attention(
        q, cache, table, torch.tensor(lens), scale, -1, cap
    )
    uncapped = torch.ops.genserve.paged_decode_attention(
        q, cache, table, torch.tensor(lens), scale, -1
    )
    group = num_heads // num_kv_heads
    for s, length in enumerate(lens):
        ctx = cache[:, :, table[s]].reshape(2, num_kv_heads, -1, head_dim)[:, :, :length].double()
        for h in range(num_heads):
            scores = ctx[0, h // group] @ q[s, h].double() * scale
            probs = torch.softmax(torch.tanh(scores / cap) * cap, dim=0)
            expected = probs @ ctx[1, h // group]
            torch.testing.assert_close(out[s, h].double(), expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(out, uncapped, atol=1e-3)  # the cap changed the result


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "lengths"), [
    (4, 1, [1500, 700, 40]),  # one KV head: 3 tasks, fewer than 4 a thread, so contexts split
    (9, 3, [1100, 300]),
    (2, 2, [513]),  # just long enough for two parts
])  # fmt: skip
@pytest.mark.parametrize("window", [None, 600])
def test_long_contexts_split_in_parts_match_the_reference(
    dtype: torch.dtype,
    tolerance: float,
    num_heads: int,
    num_kv_heads: int,
    lengths: list[int],
    window: int | None,
) -> None:
    """Few sequences with long contexts are attended in parts of the context, combined by
    their softmax statistics (the kernel's split path): the same result as one pass."""
    gen = torch.Generator().manual_seed(len(lengths))
    head_dim = 64
    needed = [math.ceil(n / BLOCK_SIZE) for n in lengths]
    num_blocks = sum(needed) + 8
    cache = torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=gen)
    q = torch.randn(len(lengths), num_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for length, n in zip(lengths, needed, strict=True):
        seqs.append(SeqSpec(1, length - 1, tuple(free[:n])))
        free = free[n:]
    q, cache = q.to(dtype), cache.to(dtype)
    table = torch.zeros(len(seqs), max(needed), dtype=torch.int64)
    for i, seq in enumerate(seqs):
        table[i, : len(seq.block_ids)] = torch.tensor(seq.block_ids)
    lens = torch.tensor(lengths)
    scale = head_dim**-0.5
    for threads in (1, 2):  # the number of parts follows the thread count
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = torch.ops.genserve.paged_decode_attention(
                q, cache, table, lens, scale, -1 if window is None else window
            )
        finally:
            torch.set_num_threads(previous)
        expected = _reference(q, cache, seqs, scale, window)
        torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("head_dim", [64, 24])  # vectorised (and split) path; generic path
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_sinks_match_the_eager_reference(head_dim: int, threads: int) -> None:
    """gpt-oss's attention sinks: each head's sink logit joins its softmax's denominator as a
    key whose value is zero, on the whole-context, split-context and generic-size paths;
    leaving them out changes the result."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads, blocks = 4, 2, 80
    cache = torch.randn(2, num_kv_heads, blocks, BLOCK_SIZE, head_dim, generator=gen)
    lens = [1100, 30, 3]  # the long context is split in parts (head size 64)
    table = torch.tensor([list(range(70)), list(range(70, 72)) + [0] * 68, [72] + [0] * 69])
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen) * 2
    sinks = torch.tensor([3.0, -1.0, 0.5, 40.0])  # the last dwarfs every score
    scale = head_dim**-0.5
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.ops.genserve.paged_decode_attention(
            q, cache, table, torch.tensor(lens), scale, -1, 0.0, sinks
        )
        plain = torch.ops.genserve.paged_decode_attention(
            q, cache, table, torch.tensor(lens), scale, -1
        )
    finally:
        torch.set_num_threads(previous)
    group = num_heads // num_kv_heads
    for s, length in enumerate(lens):
        ctx = cache[:, :, table[s]].reshape(2, num_kv_heads, -1, head_dim)[:, :, :length].double()
        for h in range(num_heads):
            scores = ctx[0, h // group] @ q[s, h].double() * scale
            with_sink = torch.cat([scores, sinks[h : h + 1].double()])
            probs = torch.softmax(with_sink, dim=0)[:-1]
            expected = probs @ ctx[1, h // group]
            torch.testing.assert_close(out[s, h].double(), expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks changed the result
    with pytest.raises(RuntimeError, match="sinks must be float32"):
        torch.ops.genserve.paged_decode_attention(
            q, cache, table, torch.tensor(lens), scale, -1, 0.0, sinks[:3]
        )
