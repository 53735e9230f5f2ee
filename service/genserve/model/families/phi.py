"""Phi-1/1.5/2 (``PhiForCausalLM``): one LayerNorm feeding attention and a GELU MLP in
parallel, partial rotary, biases everywhere (the LM head too)."""

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
    QKNorm,
    WeightNames,
)

ARCHITECTURES = ("PhiForCausalLM",)

NAMES = WeightNames(
    o="self_attn.dense",
    q_norm="self_attn.q_layernorm",
    k_norm="self_attn.k_layernorm",
    up="mlp.fc1",
    down="mlp.fc2",
    final_norm="model.final_layernorm",
    lm_head_bias=True,
)


def config(hf: Any, architecture: str) -> ModelConfig:
    norm = NormSpec(NormKind.LAYER, float(hf.layer_norm_eps), bias=True)
    qk_norm = QKNorm.PER_HEAD if getattr(hf, "qk_layernorm", False) else QKNorm.NONE
    return base_config(
        hf,
        architecture,
        norm=norm,
        attention=AttentionSpec(
            True, True, rotary_dim=rotary_dim(hf), qk_norm=qk_norm, qk_norm_spec=norm
        ),
        mlp=MlpSpec(activation(hf.hidden_act), gated=False, bias=True),
        block=BlockSpec(parallel=True, pre_mlp_norm=False),
        names=NAMES,
    )
