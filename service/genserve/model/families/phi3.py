"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): Llama's block with fused checkpoint matrices
(``qkv_proj`` as ``[q | k | v]``, ``gate_up_proj`` as ``[gate | up]``), longrope scaling
and, on Phi-4-mini, partial rotary."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config, rotary_dim
from genserve.model.spec import (
    AttentionSpec,
    MlpSpec,
    ModelConfig,
    NormSpec,
    QKVLayout,
    WeightNames,
)

ARCHITECTURES = ("Phi3ForCausalLM",)

NAMES = WeightNames(
    q="self_attn.qkv_proj", qkv_layout=QKVLayout.FUSED, gate="", up="mlp.gate_up_proj"
)


def config(hf: Any, architecture: str) -> ModelConfig:
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        attention=AttentionSpec(rotary_dim=rotary_dim(hf)),
        mlp=MlpSpec(activation(hf.hidden_act)),
        names=NAMES,
    )
