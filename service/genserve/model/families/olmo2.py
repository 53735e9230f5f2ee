"""OLMo-2: norms after each sublayer only (none before), and an RMSNorm over all query
(and all key) features at once, before the heads are split and rotated."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import (
    AttentionSpec,
    BlockSpec,
    MlpSpec,
    ModelConfig,
    NormSpec,
    QKNorm,
)

ARCHITECTURES = ("Olmo2ForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    norm = NormSpec(eps=float(hf.rms_norm_eps))
    bias = bool(getattr(hf, "attention_bias", False))
    return base_config(
        hf,
        architecture,
        norm=norm,
        attention=AttentionSpec(bias, bias, qk_norm=QKNorm.FULL_WIDTH, qk_norm_spec=norm),
        mlp=MlpSpec(activation(hf.hidden_act)),
        block=BlockSpec(
            pre_attn_norm=False, post_attn_norm=True, pre_mlp_norm=False, post_mlp_norm=True
        ),
    )
