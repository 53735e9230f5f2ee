"""StableLM-2: LayerNorm (with bias), partial rotary, optional q/k/v biases, and either a
sequential block or (``use_parallel_residual``) attention and MLP reading one norm."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config, rotary_dim
from genserve.model.spec import (
    AttentionSpec,
    BlockSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    UnsupportedModelError,
)

ARCHITECTURES = ("StableLmForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    if getattr(hf, "qk_layernorm", False):
        raise UnsupportedModelError("StableLM's per-head q/k LayerNorm is not native")
    parallel = bool(getattr(hf, "use_parallel_residual", False))
    return base_config(
        hf,
        architecture,
        norm=NormSpec(NormKind.LAYER, float(hf.layer_norm_eps), bias=True),
        attention=AttentionSpec(qkv_bias=bool(hf.use_qkv_bias), rotary_dim=rotary_dim(hf)),
        mlp=MlpSpec(activation(hf.hidden_act)),
        block=BlockSpec(parallel=parallel, pre_mlp_norm=not parallel),
    )
