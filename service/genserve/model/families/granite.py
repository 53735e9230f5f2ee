"""Granite (dense): Llama's parts with four multipliers — embeddings, each sublayer's
residual contribution, the softmax scale (``attention_multiplier``) and the logits
(divided by ``logits_scaling``)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import AttentionSpec, BlockSpec, MlpSpec, ModelConfig, NormSpec

ARCHITECTURES = ("GraniteForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        attention=AttentionSpec(bias, bias, scale=float(hf.attention_multiplier)),
        mlp=MlpSpec(activation(hf.hidden_act), bias=bool(getattr(hf, "mlp_bias", False))),
        block=BlockSpec(residual_multiplier=float(hf.residual_multiplier)),
        embed_scale=float(hf.embedding_multiplier),
        logit_divisor=float(hf.logits_scaling),
    )
