"""Gemma 3 (text): Gemma 2's block with a ``(1 + w)`` RMSNorm over each head's queries and
keys, and a rotary base of its own on the sliding layers (``rope_parameters`` per layer
type).  Served for ``Gemma3ForCausalLM`` checkpoints (the text-only model)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config, rope_config
from genserve.model.families.gemma import embed_scale
from genserve.model.families.gemma2 import SANDWICH, SANDWICH_NAMES
from genserve.model.spec import AttentionSpec, MlpSpec, ModelConfig, NormKind, NormSpec, QKNorm

ARCHITECTURES = ("Gemma3ForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    norm = NormSpec(NormKind.RMS_ONE_PLUS, float(hf.rms_norm_eps))
    bias = bool(getattr(hf, "attention_bias", False))
    attention = AttentionSpec(
        bias,
        bias,
        scale=float(hf.query_pre_attn_scalar) ** -0.5,
        softcap=getattr(hf, "attn_logit_softcapping", None),
        qk_norm=QKNorm.PER_HEAD,
        qk_norm_spec=norm,
    )
    types = list(hf.layer_types)
    return base_config(
        hf,
        architecture,
        rope=rope_config(hf, "full_attention"),
        local_rope=rope_config(hf, "sliding_attention"),
        layer_ropes=tuple(1 if t == "sliding_attention" else 0 for t in types),
        norm=norm,
        attention=attention,
        mlp=MlpSpec(activation(hf.hidden_activation)),
        block=SANDWICH,
        names=SANDWICH_NAMES,
        embed_scale=embed_scale(hf),
        final_softcap=getattr(hf, "final_logit_softcapping", None),
    )
