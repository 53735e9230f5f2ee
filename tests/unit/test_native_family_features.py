"""Each native family's features matter: the decoder built from the family's spec gives
transformers' logits (float32, a 100-token prompt, past every sliding window and scaled
rotary's original context), and the same decoder with one feature switched off does not —
so the parity tests (tests/e2e/test_native_families.py) would catch a skipped feature."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.config import ModelConfig, load_model_config
from genserve.model.registry import build_model
from genserve.model.spec import NormKind, QKNorm, RopeConfig
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from tests.conftest import TinyModelFactory

Ablation = Callable[[ModelConfig], ModelConfig]
replace = dataclasses.replace


def _attn(**changes: object) -> Ablation:
    return lambda c: replace(c, attention=replace(c.attention, **changes))


def _block(**changes: object) -> Ablation:
    return lambda c: replace(c, block=replace(c.block, **changes))


def _top(**changes: object) -> Ablation:
    return lambda c: replace(c, **changes)


def _no_windows(c: ModelConfig) -> ModelConfig:
    return replace(c, sliding_windows=(None,) * c.num_layers)


def _plain_rope(c: ModelConfig) -> ModelConfig:
    return replace(c, rope=RopeConfig(theta=c.rope.theta))


ABLATIONS: list[tuple[str, str, Ablation]] = [
    ("qwen3", "q/k norm", _attn(qk_norm=QKNorm.NONE)),
    ("qwen2-yarn", "yarn rotary", _plain_rope),
    ("gemma", "(1 + w) norm", lambda c: replace(c, norm=replace(c.norm, kind=NormKind.RMS))),
    ("gemma", "embedding scale", _top(embed_scale=1.0)),
    ("gemma2", "attention soft-cap", _attn(softcap=None)),
    ("gemma2", "final soft-cap", _top(final_softcap=None)),
    ("gemma2", "query_pre_attn_scalar", _attn(scale=None)),
    ("gemma2", "post-sublayer norms", _block(post_attn_norm=False, post_mlp_norm=False)),
    ("gemma2", "sliding window", _no_windows),
    ("gemma3", "local rotary base", _top(local_rope=None, layer_ropes=())),
    ("gemma3", "q/k norm", _attn(qk_norm=QKNorm.NONE)),
    ("phi3", "longrope", _plain_rope),
    ("granite", "residual multiplier", _block(residual_multiplier=1.0)),
    ("granite", "embedding multiplier", _top(embed_scale=1.0)),
    ("granite", "attention multiplier", _attn(scale=None)),
    ("granite", "logits scaling", _top(logit_divisor=1.0)),
    ("olmo2", "full-width q/k norm", _attn(qk_norm=QKNorm.NONE)),
    ("stablelm", "partial rotary", _attn(rotary_dim=None)),
    ("stablelm", "q/k/v bias", _attn(qkv_bias=False)),
    ("phi", "parallel block", _block(parallel=False)),
    ("phi", "LM head bias", lambda c: replace(c, names=replace(c.names, lm_head_bias=False))),
    ("gpt_neox", "partial rotary", _attn(rotary_dim=None)),
    ("gpt_neox", "parallel block", _block(parallel=False)),
    ("starcoder2", "sliding window", _no_windows),
    ("starcoder2", "MLP bias", lambda c: replace(c, mlp=replace(c.mlp, bias=False))),
    ("cohere", "interleaved rotary", _attn(interleaved_rotary=False)),
    ("cohere", "logit scale", _top(logit_scale=1.0)),
    ("cohere", "per-head q/k LayerNorm", _attn(qk_norm=QKNorm.NONE)),
    ("smollm3", "no-rope layers", _top(layer_ropes=())),
]
NUM_TOKENS = 100


def _logits(config: ModelConfig, model_dir: object, ids: torch.Tensor) -> torch.Tensor:
    cpu = torch.device("cpu")
    model = build_model(config, ParallelContext.single(), torch.float32, cpu)
    with SafetensorsWeights(model_dir) as weights:  # type: ignore[arg-type]
        model.load_weights(weights)
    backend = TorchPagedAttention(cpu)
    shape = backend.kv_cache_shape(8, 16, model.num_local_kv_heads, config.head_dim)
    caches = [torch.zeros(shape) for _ in range(config.num_layers)]
    meta = backend.build([SeqSpec(NUM_TOKENS, 0, tuple(range(8)))], 0, 16)
    return model.compute_logits(model(ids, torch.arange(NUM_TOKENS), caches, meta))


@pytest.mark.parametrize(
    ("family", "feature", "ablate"), ABLATIONS, ids=[f"{a[0]}-{a[1]}" for a in ABLATIONS]
)
def test_feature_changes_the_reference(
    family: str, feature: str, ablate: Ablation, tiny_model_factory: TinyModelFactory
) -> None:
    model_dir = tiny_model_factory(family, seed=1)
    config = load_model_config(model_dir)
    ids = torch.randint(3, 40000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(ids[None]).logits[0].float()
        assert torch.allclose(_logits(config, model_dir, ids), want, atol=1e-4)
        skipped = _logits(ablate(config), model_dir, ids)
    assert (skipped - want).abs().max() > 1e-2, f"{family}: {feature} changes nothing"
