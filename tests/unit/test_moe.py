"""Mixture-of-experts (model/moe.py, kernels/moe_cpu.cpp): each native MoE family's decoder
gives transformers' logits, with the torch expert loop and with the fused CPU op; skipping
a routing feature or the shared expert changes the reference (so the parity tests would
catch it); and the op equals the torch loop at 1 row, a few rows, and prefill sizes where
experts go to the GEMM path, in float32 and bfloat16."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.config import ModelConfig, load_model_config
from genserve.model.moe import SparseMoeBlock, experts_torch, route
from genserve.model.registry import build_model
from genserve.model.spec import ClampedSwiGLU, QKNorm, RouterSpec, Scoring
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import default_tokenizer_dir
from tests.utils.moe_models import MOE_FAMILIES, make_moe_model

NUM_TOKENS = 80
Ablation = Callable[[ModelConfig], ModelConfig]
replace = dataclasses.replace


def _router(**changes: object) -> Ablation:
    def ablate(c: ModelConfig) -> ModelConfig:
        assert c.moe is not None
        return replace(c, moe=replace(c.moe, router=replace(c.moe.router, **changes)))

    return ablate


def _moe(**changes: object) -> Ablation:
    def ablate(c: ModelConfig) -> ModelConfig:
        assert c.moe is not None
        return replace(c, moe=replace(c.moe, **changes))

    return ablate


def _attention(**changes: object) -> Ablation:
    def ablate(c: ModelConfig) -> ModelConfig:
        return replace(c, attention=replace(c.attention, **changes))

    return ablate


def _no_window(c: ModelConfig) -> ModelConfig:
    return replace(c, sliding_windows=(None,) * c.num_layers)


ABLATIONS: list[tuple[str, str, Ablation]] = [
    ("mixtral", "renormalised top-k", _router(renormalize=False)),
    ("mixtral", "top-2 (not 1)", _router(top_k=1)),
    ("qwen3_moe", "renormalised top-k", _router(renormalize=False)),
    ("qwen2_moe", "shared expert", _moe(shared_intermediate_size=0)),
    ("qwen2_moe", "shared expert gate", _moe(shared_gate=False)),
    ("qwen2_moe", "plain top-k weights", _router(renormalize=True)),
    ("glm4_moe", "correction bias", _router(correction_bias=False)),
    ("glm4_moe", "expert groups", _router(num_groups=1, topk_groups=1)),
    ("glm4_moe", "routed scaling", _router(scaling_factor=1.0)),
    ("glm4_moe", "sigmoid scoring", _router(scoring=Scoring.SOFTMAX)),
    ("glm4_moe", "shared experts", _moe(shared_intermediate_size=0)),
    ("gpt_oss", "attention sinks", _attention(sinks=False)),
    ("gpt_oss", "sliding window", _no_window),
    ("gpt_oss", "clamped SwiGLU", _moe(activation=None)),
    ("gpt_oss", "expert biases", _moe(expert_bias=False)),
    ("gpt_oss", "router bias", _router(bias=False)),
    ("gpt_oss", "softmax over the top-k", _router(scoring=Scoring.SOFTMAX)),
    ("minimax_m2", "correction bias", _router(correction_bias=False)),
    ("minimax_m2", "renormalised weights", _router(renormalize=False)),
    ("minimax_m2", "full-width q/k norm", _attention(qk_norm=QKNorm.NONE)),
]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    tok = default_tokenizer_dir()
    return {f: make_moe_model(root / f, f, tok, seed=2) for f in MOE_FAMILIES}


def _kernels() -> bool:
    return cpu_kernels.usable(torch.device("cpu"), torch.float32)


def _logits(config: ModelConfig, model_dir: Path, ids: torch.Tensor, fused: bool) -> torch.Tensor:
    cpu = torch.device("cpu")
    model = build_model(config, ParallelContext.single(), torch.float32, cpu)
    with SafetensorsWeights(model_dir) as weights:
        model.load_weights(weights)
    if fused:
        model.use_fused_cpu_ops()
    backend = TorchPagedAttention(cpu)
    shape = backend.kv_cache_shape(8, 16, model.num_local_kv_heads, config.head_dim)
    caches = [torch.zeros(shape) for _ in range(config.num_layers)]
    meta = backend.build([SeqSpec(NUM_TOKENS, 0, tuple(range(8)))], 0, 16)
    return model.compute_logits(model(ids, torch.arange(NUM_TOKENS), caches, meta))


def _reference(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return hf(ids[None]).logits[0].float()


def _ids() -> torch.Tensor:
    return torch.randint(3, 40000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_family_logits_match_transformers(family: str, moe_dirs: dict[str, Path]) -> None:
    model_dir = moe_dirs[family]
    config = load_model_config(model_dir)
    assert config.moe is not None and config.moe.router.num_experts == 8
    with torch.inference_mode():
        want = _reference(model_dir, _ids())
        assert torch.allclose(_logits(config, model_dir, _ids(), fused=False), want, atol=1e-4)
        if _kernels():  # the same through genserve::moe_experts
            got = _logits(config, model_dir, _ids(), fused=True)
            assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize(
    ("family", "feature", "ablate"), ABLATIONS, ids=[f"{a[0]}-{a[1]}" for a in ABLATIONS]
)
def test_feature_changes_the_reference(
    family: str, feature: str, ablate: Ablation, moe_dirs: dict[str, Path]
) -> None:
    model_dir = moe_dirs[family]
    config = ablate(load_model_config(model_dir))
    with torch.inference_mode():
        want = _reference(model_dir, _ids())
        skipped = _logits(config, model_dir, _ids(), fused=False)
    assert (skipped - want).abs().max() > 1e-2, f"{family}: {feature} changes nothing"


def test_grouped_sigmoid_routing_stays_in_the_best_groups() -> None:
    spec = RouterSpec(8, 2, Scoring.SIGMOID, renormalize=True, correction_bias=True,
                      num_groups=4, topk_groups=2, scaling_factor=2.0)  # fmt: skip
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(8)
    bias[[0, 1, 6, 7]] = 5.0  # groups 0 and 3 always win
    weights, ids = route(logits, spec, bias)
    assert set(ids.flatten().tolist()) <= {0, 1, 6, 7}
    assert torch.allclose(weights.sum(dim=-1), torch.full((50,), 2.0))


@pytest.mark.skipif(not _kernels(), reason="genserve CPU kernels unavailable")
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped-biased"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 300])
def test_op_matches_torch_loop(num_tokens: int, dtype: torch.dtype, gpt_oss: bool) -> None:
    """At 300 rows of top-2 of 8 most experts pass the GEMM threshold; at 1-16, none.
    ``gpt_oss``: with expert biases and the clamped SwiGLU (a limit the activations cross)."""
    gen = torch.Generator().manual_seed(num_tokens)
    experts, hidden, width, top_k = 8, 80, 40, 2
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (0.2 * torch.randn(experts, 2 * width, hidden, generator=gen)).to(dtype)
    w2 = (0.2 * torch.randn(experts, hidden, width, generator=gen)).to(dtype)
    logits = torch.randn(num_tokens, experts, generator=gen)
    weights, ids = route(logits, RouterSpec(experts, top_k, renormalize=True))
    b13 = b2 = clamped = None
    if gpt_oss:
        b13 = torch.randn(experts, 2 * width, generator=gen).to(dtype)
        b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
        clamped = ClampedSwiGLU(alpha=1.702, limit=1.0)
    got = torch.ops.genserve.moe_experts(
        x, ids, weights, w13, w2, b13, b2,
        0.0 if clamped is None else clamped.alpha, 0.0 if clamped is None else clamped.limit,
    )  # fmt: skip
    want = experts_torch(
        x.float(), ids, weights, w13.float(), w2.float(),
        None if b13 is None else b13.float(), None if b2 is None else b2.float(), clamped,
    )  # fmt: skip
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    if gpt_oss:  # the clamp and the biases each matter here
        plain = experts_torch(x.float(), ids, weights, w13.float(), w2.float())
        unclamped = experts_torch(
            x.float(), ids, weights, w13.float(), w2.float(), b13.float(), b2.float()
        )
        assert not torch.allclose(unclamped, want, atol=1e-2)
        assert not torch.allclose(plain, want, atol=1e-2)


@pytest.mark.skipif(not _kernels(), reason="genserve CPU kernels unavailable")
def test_op_refuses_bad_expert_ids() -> None:
    x = torch.randn(2, 16)
    w13, w2 = torch.randn(4, 8, 16), torch.randn(4, 16, 4)
    ids = torch.tensor([[0, 4], [1, 2]])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.genserve.moe_experts(x, ids, torch.ones(2, 2), w13, w2)


def test_block_is_built_for_moe_layers_only(moe_dirs: dict[str, Path]) -> None:
    config = load_model_config(moe_dirs["qwen3_moe"])
    model = build_model(config, ParallelContext.single(), torch.float32, torch.device("cpu"))
    kinds = [isinstance(layer.mlp, SparseMoeBlock) for layer in model._layers]
    assert kinds == [False, True]
