"""Gemma (1): RMSNorm with ``(1 + w)``, a GeGLU MLP (tanh GELU), embeddings scaled by
``sqrt(hidden_size)``, tied head."""

from __future__ import annotations

import math
from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import AttentionSpec, MlpSpec, ModelConfig, NormKind, NormSpec

ARCHITECTURES = ("GemmaForCausalLM",)


def embed_scale(hf: Any) -> float:
    """transformers multiplies by ``torch.tensor(hidden ** 0.5)`` in the weights' dtype."""
    return float(math.sqrt(hf.hidden_size))


def config(hf: Any, architecture: str) -> ModelConfig:
    act = getattr(hf, "hidden_activation", None) or hf.hidden_act
    bias = bool(getattr(hf, "attention_bias", False))
    return base_config(
        hf,
        architecture,
        norm=NormSpec(NormKind.RMS_ONE_PLUS, float(hf.rms_norm_eps)),
        attention=AttentionSpec(bias, bias),
        mlp=MlpSpec(activation(act)),
        embed_scale=embed_scale(hf),
    )
