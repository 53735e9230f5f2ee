"""Llama, Mistral, Qwen2 (and Qwen2.5, whose YaRN scaling is a rope kind): pre-norm RMSNorm
blocks, grouped-query attention, a SiLU-gated MLP."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import AttentionSpec, MlpSpec, ModelConfig, NormSpec

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def config(hf: Any, architecture: str) -> ModelConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama's flag covers all four.
        attention=AttentionSpec(qkv_bias=is_qwen2 or bias, o_bias=bias and not is_qwen2),
        mlp=MlpSpec(activation(hf.hidden_act), bias=bool(getattr(hf, "mlp_bias", False))),
    )
