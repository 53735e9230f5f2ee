"""Cohere (Command-R): LayerNorm without bias feeding attention and MLP in parallel,
interleaved rotary, optional per-head q/k LayerNorm, logits multiplied by ``logit_scale``."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import (
    AttentionSpec,
    BlockSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    QKNorm,
)

ARCHITECTURES = ("CohereForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    norm = NormSpec(NormKind.LAYER, float(hf.layer_norm_eps), bias=False)
    bias = bool(getattr(hf, "attention_bias", False))
    qk_norm = QKNorm.PER_HEAD if getattr(hf, "use_qk_norm", False) else QKNorm.NONE
    return base_config(
        hf,
        architecture,
        norm=norm,
        attention=AttentionSpec(
            bias,
            bias,
            qk_norm=qk_norm,
            qk_norm_spec=norm,
            qk_norm_weights_per_head=True,
            interleaved_rotary=True,
        ),
        mlp=MlpSpec(activation(hf.hidden_act)),
        block=BlockSpec(parallel=True, pre_mlp_norm=False),
        logit_scale=float(hf.logit_scale),
    )
