"""Qwen3: Qwen2 with an RMSNorm over each head's queries and keys (before the rotation),
no q/k/v biases (``attention_bias`` names them all)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import AttentionSpec, MlpSpec, ModelConfig, NormSpec, QKNorm

ARCHITECTURES = ("Qwen3ForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    norm = NormSpec(eps=float(hf.rms_norm_eps))
    bias = bool(getattr(hf, "attention_bias", False))
    return base_config(
        hf,
        architecture,
        norm=norm,
        attention=AttentionSpec(bias, bias, qk_norm=QKNorm.PER_HEAD, qk_norm_spec=norm),
        mlp=MlpSpec(activation(hf.hidden_act)),
    )
