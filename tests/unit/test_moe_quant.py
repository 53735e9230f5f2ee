"""``--quantize int8|int4``'s routed experts (``model/moe_quant.py``): the Q8_0 / Q4_0 blocks
are byte for byte what gguf-py's quantizers write; a quantized MoE model holds its experts in
those blocks at 34 / 18 bytes per 32 weights, and the CPU expert op on them gives the logits
of the dequantized reference (the torch loop over gguf-py's dequantized blocks); experts the
op cannot run (widths off the block) stay in the model dtype and are named.  gpt-oss's
experts are quantized too: their biases and clamped SwiGLU are the op's optional arguments."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.config import load_model_config
from genserve.model.moe import SparseMoeBlock
from genserve.model.moe_quant import quantize_experts, quantize_rows, why_float
from genserve.model.quantize_model import quantize_model
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import default_tokenizer_dir
from tests.utils.moe_models import make_moe_model


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])
def test_blocks_equal_gguf_py_quantizer(qtype: str) -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(9, 128, generator=gen) * 0.3
    w[0, :32] = 0  # an all-zero block: scale 0
    w[1, :32] = torch.linspace(-1, 1, 32)  # ties of magnitude, halves to round
    w[2, 32:64] = 0.25 * torch.arange(-16, 16)
    got = quantize_rows(w, qtype).numpy()
    want = quants.quantize(w.numpy(), GGMLQuantizationType[qtype])
    assert got.shape == want.shape and np.array_equal(got, want)


def test_rows_off_the_block_are_refused() -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_rows(torch.zeros(2, 48), "Q8_0")


def test_experts_stack_per_projection() -> None:
    w13 = torch.randn(4, 2 * 32, 64)
    w2 = torch.randn(4, 64, 32)
    q = quantize_experts(w13, w2, "int4")
    assert q.types == ("Q4_0",) * 3
    assert q.gate.shape == q.up.shape == (4, 32, 2 * 18)
    assert q.down.shape == (4, 64, 18)
    assert torch.equal(q.up[2], quantize_rows(w13[2, 32:], "Q4_0"))
    assert q.nbytes * 32 == (w13.numel() + w2.numel()) * 18  # 18 bytes per 32 weights


def test_reasons_to_stay_float() -> None:
    assert why_float(64, 32) is None
    assert "multiple of 32" in str(why_float(64, 48))
    assert "multiple of 32" in str(why_float(40, 32))


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-quant")
    tok = default_tokenizer_dir()
    return {
        "glm4_moe": make_moe_model(root / "glm4_moe", "glm4_moe", tok, seed=3),
        "mixtral": make_moe_model(root / "mixtral", "mixtral", tok, seed=3),  # width 48
        "gpt_oss": make_moe_model(root / "gpt_oss", "gpt_oss", tok, seed=3),
    }


def _model(model_dir: Path, method: str, fused: bool) -> tuple[object, list[SparseMoeBlock]]:
    config = load_model_config(model_dir)
    model = build_model(config, ParallelContext.single(), torch.float32, torch.device("cpu"))
    with SafetensorsWeights(model_dir) as weights:
        model.load_weights(weights)
    float_experts = sum(
        m.w13.nbytes + m.w2.nbytes for m in model.modules() if isinstance(m, SparseMoeBlock)
    )
    summary = quantize_model(model, method)
    if fused:
        model.use_fused_cpu_ops()
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    model.float_experts = float_experts  # type: ignore[attr-defined]
    model.summary = summary  # type: ignore[attr-defined]
    return model, blocks


def _logits(model: object, model_dir: Path) -> torch.Tensor:
    config = load_model_config(model_dir)
    num_tokens = 40
    ids = torch.randint(3, 40000, (num_tokens,), generator=torch.Generator().manual_seed(0))
    backend = TorchPagedAttention(torch.device("cpu"))
    shape = backend.kv_cache_shape(4, 16, model.num_local_kv_heads, config.head_dim)  # type: ignore[attr-defined]
    caches = [torch.zeros(shape) for _ in range(config.num_layers)]
    meta = backend.build([SeqSpec(num_tokens, 0, tuple(range(4)))], 0, 16)
    out: torch.Tensor = model.compute_logits(model(ids, torch.arange(num_tokens), caches, meta))  # type: ignore[attr-defined,operator]
    return out


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("family", ["glm4_moe", "gpt_oss"])
def test_quantized_experts_on_the_op(family: str, method: str, moe_dirs: dict[str, Path]) -> None:
    """GLM-4-MoE (sigmoid routing, shared expert) and gpt-oss (expert biases, clamped
    SwiGLU: its float biases stay beside the blocks)."""
    model_dir = moe_dirs[family]
    with torch.inference_mode():
        fused, blocks = _model(model_dir, method, fused=True)
        assert blocks and all(b.quantized_experts is not None for b in blocks)
        assert all(b.w13.numel() == 0 for b in blocks)  # the float copy is gone
        held = sum(b.quantized_experts.nbytes for b in blocks if b.quantized_experts)
        per_block = 34 if method == "int8" else 18
        assert held * 128 == fused.float_experts * per_block  # type: ignore[attr-defined]
        assert not any("experts" in k for k in fused.summary.kept)  # type: ignore[attr-defined]
        reference, _ = _model(model_dir, method, fused=False)  # dequantized torch loop
        torch.testing.assert_close(
            _logits(fused, model_dir), _logits(reference, model_dir), atol=1e-4, rtol=1e-4
        )


@pytest.mark.parametrize("family", ["mixtral"])
def test_experts_the_op_cannot_run_stay_float_and_are_named(
    family: str, moe_dirs: dict[str, Path]
) -> None:
    with torch.inference_mode():
        model, blocks = _model(moe_dirs[family], "int8", fused=False)
    assert blocks and all(b.quantized_experts is None and b.w13.numel() > 0 for b in blocks)
    kept = model.summary.kept  # type: ignore[attr-defined]
    first = load_model_config(moe_dirs[family]).num_layers - len(blocks)
    assert [k for k in kept if k.endswith("experts")] == [
        f"model.layers.{i} experts" for i in range(first, first + len(blocks))
    ]
