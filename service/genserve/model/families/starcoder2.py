"""StarCoder2: LayerNorm (with bias), biases on every projection (``use_bias``), a
non-gated tanh-GELU MLP (``c_fc``/``c_proj``), a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import (
    AttentionSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    WeightNames,
)

ARCHITECTURES = ("Starcoder2ForCausalLM",)

NAMES = WeightNames(up="mlp.c_fc", down="mlp.c_proj")


def config(hf: Any, architecture: str) -> ModelConfig:
    bias = bool(hf.use_bias)
    return base_config(
        hf,
        architecture,
        norm=NormSpec(NormKind.LAYER, float(hf.norm_epsilon), bias=True),
        attention=AttentionSpec(bias, bias),
        mlp=MlpSpec(activation(hf.hidden_act), gated=False, bias=bias),
        names=NAMES,
    )
