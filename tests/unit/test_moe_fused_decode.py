"""Mixture-of-experts layers in the fused CPU decode path: each MoE layer's attention half,
router and routed experts run as one op (``genserve::decode_moe_layer``,
kernels/decode_layer_cpu.cpp; the router is ``genserve::moe_route``, moe_route_cpu.cpp), the
shared expert after it; a MoE model's dense layers run whole (``genserve::decode_layer``).  A
decode-only step must give bit-identical hidden states and K/V to the per-op path, for the
float families (tiny transformers checkpoints) and for a GGUF file with K-quant experts, and
the router op the same weights and experts as model/moe.py's ``route``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.config import load_model_config
from genserve.model.fused_decode import unsupported_reason
from genserve.model.moe import SparseMoeBlock, route, routing_codes
from genserve.model.registry import build_model
from genserve.model.spec import RouterSpec, Scoring
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import default_tokenizer_dir
from tests.utils.moe_models import MOE_FAMILIES, make_moe_model

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")

# gpt-oss's attention sinks are not in the op: its layers keep the per-op path.
FUSED_FAMILIES = sorted(f for f in MOE_FAMILIES if f != "gpt_oss")


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-fused")
    tok = default_tokenizer_dir()
    return {f: make_moe_model(root / f, f, tok, seed=3) for f in MOE_FAMILIES}


def _decode_both_ways(
    model: DecoderForCausalLM, dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, list[torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]]:
    """One decode-only step of three sequences (random K/V already cached; one context
    crosses the tiny families' sliding window) through the fused layers and the per-op
    path, from the same caches: ``(hidden, K/V)`` of each."""
    config = model.config
    backend = TorchPagedAttention(torch.device("cpu"), use_cpu_kernel=True)
    shape = backend.kv_cache_shape(16, 16, model.num_local_kv_heads, config.head_dim)
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(config.num_layers)]
    lens = (57, 5, 40)
    tables = [(4, 2, 6, 13), (9,), (11, 12, 14)]
    decodes = [SeqSpec(1, n, t) for n, t in zip(lens, tables, strict=True)]
    tokens = torch.tensor([7, 100, 3])
    positions = torch.tensor(lens) - 1

    def step(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model._decode_layers_fused = fused
        kv = [c.clone() for c in caches]
        hidden = model(tokens, positions, kv, backend.build(decodes, len(decodes), 16))
        return hidden, kv

    with torch.inference_mode():
        return step(True), step(False)


def _assert_identical(
    fused: tuple[torch.Tensor, list[torch.Tensor]], plain: tuple[torch.Tensor, list[torch.Tensor]]
) -> None:
    (fused_hidden, fused_kv), (plain_hidden, plain_kv) = fused, plain
    assert torch.isfinite(fused_hidden).all()
    assert torch.equal(fused_hidden, plain_hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, plain_kv, strict=True))


def _op_names(model: DecoderForCausalLM) -> list[str]:
    """The op each layer's decode step runs (a MoE layer's experts included or not)."""
    names = []
    for layer in model._layers:
        moe = isinstance(layer.mlp, SparseMoeBlock) and layer.mlp.decode_args() is not None
        names.append((layer._moe_decode_op if moe else layer.fused_decode_call[0]).name())
    return names


@pytest.mark.parametrize(
    ("dtype", "matvec_rows"),
    [(torch.float32, 32), (torch.bfloat16, 32), (torch.bfloat16, 2)],
)
@pytest.mark.parametrize("family", FUSED_FAMILIES)
def test_moe_layers_decode_through_the_fused_attention_like_the_per_op_path(
    moe_dirs: dict[str, Path], family: str, dtype: torch.dtype, matvec_rows: int
) -> None:
    """Routing of every kind (softmax top-k renormalised or not, sigmoid with correction
    bias and groups), shared experts gated or not, dense first layers, q/k norms, biases,
    partial rotary and sliding windows: the fused step equals the per-op one bit for bit."""
    config = load_model_config(moe_dirs[family])
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), dtype, torch.device("cpu"))
        assert isinstance(model, DecoderForCausalLM)
        with SafetensorsWeights(moe_dirs[family]) as weights:
            model.load_weights(weights)
        model.use_fused_cpu_ops(matvec_rows=matvec_rows)
    assert model.decode_layers_fused, f"{family} does not take the fused decode path"
    moe = [isinstance(layer.mlp, SparseMoeBlock) for layer in model._layers]
    assert any(moe)
    expected = ["genserve::decode_moe_layer" if m else "genserve::decode_layer" for m in moe]
    assert _op_names(model) == expected
    _assert_identical(*_decode_both_ways(model, dtype))


def test_attention_sinks_keep_the_per_op_path(moe_dirs: dict[str, Path]) -> None:
    config = load_model_config(moe_dirs["gpt_oss"])
    assert unsupported_reason(config) == "attention sinks"
    model = build_model(config, ParallelContext.single(), torch.float32, torch.device("cpu"))
    assert isinstance(model, DecoderForCausalLM)
    model.use_fused_cpu_ops()
    assert not model.decode_layers_fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_k_quant_experts_from_a_gguf_file(
    tmp_path: Path,
    dtype: torch.dtype,
    build_gguf: Callable[[Path, torch.dtype], DecoderForCausalLM],
) -> None:
    """A Qwen3-MoE GGUF file with Q4_K_M experts (K-quant blocks through
    ``genserve::moe_experts_gguf``) and Q4_K attention: the same equality."""
    model = build_gguf(tmp_path, dtype)
    blocks = [layer.mlp for layer in model._layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks and all(b.quantized_experts is not None for b in blocks)
    assert model.decode_layers_fused
    assert set(_op_names(model)) == {"genserve::decode_moe_layer"}
    _assert_identical(*_decode_both_ways(model, dtype))


@pytest.fixture
def build_gguf() -> Callable[[Path, torch.dtype], DecoderForCausalLM]:
    def build(tmp_path: Path, dtype: torch.dtype) -> DecoderForCausalLM:
        from genserve.model.gguf_weights import GGUFWeights
        from genserve.model.loader import resolve_model
        from genserve.model.quantize_model import quantize_model
        from genserve.testing.moe_gguf import write_moe_gguf

        # K-quant rows are whole 256-weight super-blocks: every matrix's input is 256 wide.
        model_dir = make_moe_model(
            tmp_path / "q3", "qwen3_moe", default_tokenizer_dir(), seed=4, mlp_only_layers=[],
            hidden_size=256, head_dim=64, moe_intermediate_size=256,
        )  # fmt: skip
        gguf_file, _ = write_moe_gguf(tmp_path / "q3.gguf", model_dir, "Q4_K_M", "Q4_K")
        entry = resolve_model(str(gguf_file), cache_dir=tmp_path / "models").local_dir
        config = load_model_config(entry)
        model = build_model(config, ParallelContext.single(), dtype, torch.device("cpu"))
        assert isinstance(model, DecoderForCausalLM)
        with GGUFWeights(gguf_file, config.num_heads, config.num_kv_heads) as gguf:
            # The file itself too: the expert stacks go to the MoE blocks as their blocks.
            quantize_model(model, "gguf", gguf.quantized_view(), gguf)
            with torch.inference_mode():
                model.load_weights(gguf)
        model.use_fused_cpu_ops(matvec_rows=32)
        return model

    return build


def test_moe_layers_keep_the_attention_half_where_the_experts_are_not_on_the_kernels(
    moe_dirs: dict[str, Path],
) -> None:
    """A block whose experts are off the CPU kernels (``fused`` False) gets no routing
    arguments: its layer runs ``decode_attention`` and then the block's own forward."""
    config = load_model_config(moe_dirs["qwen2_moe"])
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), torch.float32, torch.device("cpu"))
        assert isinstance(model, DecoderForCausalLM)
        with SafetensorsWeights(moe_dirs["qwen2_moe"]) as weights:
            model.load_weights(weights)
        model.use_fused_cpu_ops(matvec_rows=32)
    blocks = [layer.mlp for layer in model._layers if isinstance(layer.mlp, SparseMoeBlock)]
    for block in blocks:
        block._fused = False  # the routed experts on the torch loop, as without the kernels
        block._decode_args = None
    assert all(block.decode_args() is None for block in blocks)
    assert "genserve::decode_attention" in _op_names(model)
    _assert_identical(*_decode_both_ways(model, torch.float32))


_ROUTERS = {
    "softmax": RouterSpec(16, 4),
    "softmax-renormalized": RouterSpec(16, 4, renormalize=True),
    "softmax-scaled": RouterSpec(16, 2, renormalize=True, scaling_factor=2.5),
    "topk-softmax-bias": RouterSpec(16, 4, Scoring.TOPK_SOFTMAX, bias=True),
    "sigmoid": RouterSpec(16, 4, Scoring.SIGMOID),
    "sigmoid-correction-renormalized": RouterSpec(
        16, 4, Scoring.SIGMOID, renormalize=True, correction_bias=True, scaling_factor=1.8
    ),
    "sigmoid-groups": RouterSpec(
        16, 4, Scoring.SIGMOID, True, True, num_groups=4, topk_groups=2
    ),  # renormalized, with the correction bias
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(_ROUTERS))
def test_router_op_equals_the_python_router(name: str, dtype: torch.dtype) -> None:
    """``genserve::moe_route`` gives ``route``'s weights and expert ids bit for bit, for every
    scoring: 1, 3 and 40 rows, with router rows repeated so that some experts tie exactly
    (top-k's tie order must agree too)."""
    spec = _ROUTERS[name]
    gen = torch.Generator().manual_seed(7)
    hidden = 64
    router = torch.randn(spec.num_experts, hidden, generator=gen)
    router[5] = router[2]  # exact ties in every row's logits
    router[11] = router[2]
    bias = torch.randn(spec.num_experts, generator=gen) if spec.bias else None
    correction = torch.rand(spec.num_experts, generator=gen) if spec.correction_bias else None
    for rows in (1, 3, 40):
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        expected = route(torch.nn.functional.linear(x.float(), router, bias), spec, correction)
        got = torch.ops.genserve.moe_route(
            x, router, bias, correction, routing_codes(spec), spec.scaling_factor
        )
        assert got[1].dtype == torch.int64 and got[0].dtype == torch.float32
        assert torch.equal(got[1], expected[1]), (name, rows)
        assert torch.equal(got[0], expected[0]), (name, rows)


def test_router_op_refuses_bad_arguments() -> None:
    router = torch.randn(8, 16)
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match="top-9 of 8"):
        torch.ops.genserve.moe_route(x, router, None, None, [0, 9, 0, 1, 1], 1.0)
    with pytest.raises(RuntimeError, match="routing must hold"):
        torch.ops.genserve.moe_route(x, router, None, None, [0, 2], 1.0)
    with pytest.raises(RuntimeError, match="unknown scoring"):
        torch.ops.genserve.moe_route(x, router, None, None, [7, 2, 0, 1, 1], 1.0)
