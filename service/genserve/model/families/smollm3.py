"""SmolLM3: Llama's parts, with rotary left out on every ``no_rope_layer_interval``-th
layer (``no_rope_layers[i] == 0``)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import AttentionSpec, MlpSpec, ModelConfig, NormSpec

ARCHITECTURES = ("SmolLM3ForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    bias = bool(getattr(hf, "attention_bias", False))
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        attention=AttentionSpec(bias, bias),
        mlp=MlpSpec(activation(hf.hidden_act), bias=bool(getattr(hf, "mlp_bias", False))),
        layer_ropes=tuple(0 if use else None for use in hf.no_rope_layers),
    )
