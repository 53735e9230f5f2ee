"""Gemma 2: Gemma's parts plus a norm after each sublayer as well as before it, attention
and final-logit soft-capping, ``query_pre_attn_scalar`` for the softmax scale, sliding and
global layers alternating (``layer_types``)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.families.gemma import embed_scale
from genserve.model.spec import (
    AttentionSpec,
    BlockSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    WeightNames,
)

ARCHITECTURES = ("Gemma2ForCausalLM",)

# Gemma 2/3: a norm before and after each sublayer.
SANDWICH = BlockSpec(post_attn_norm=True, post_mlp_norm=True)
SANDWICH_NAMES = WeightNames(pre_mlp_norm="pre_feedforward_layernorm")


def config(hf: Any, architecture: str) -> ModelConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    attention = AttentionSpec(
        bias,
        bias,
        scale=float(hf.query_pre_attn_scalar) ** -0.5,
        softcap=getattr(hf, "attn_logit_softcapping", None),
    )
    return base_config(
        hf,
        architecture,
        norm=NormSpec(NormKind.RMS_ONE_PLUS, float(hf.rms_norm_eps)),
        attention=attention,
        mlp=MlpSpec(activation(hf.hidden_activation)),
        block=SANDWICH,
        names=SANDWICH_NAMES,
        embed_scale=embed_scale(hf),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
    )
