"""GPT-NeoX (Pythia): LayerNorm, ``query_key_value`` fused per head, partial rotary, a GELU
MLP, and parallel attention + MLP each with its own norm (``use_parallel_residual``)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config, rotary_dim
from genserve.model.spec import (
    AttentionSpec,
    BlockSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    QKVLayout,
    WeightNames,
)

ARCHITECTURES = ("GPTNeoXForCausalLM",)

NAMES = WeightNames(
    embed="gpt_neox.embed_in",
    layer="gpt_neox.layers.{i}",
    q="attention.query_key_value",
    qkv_layout=QKVLayout.PER_HEAD,
    o="attention.dense",
    up="mlp.dense_h_to_4h",
    down="mlp.dense_4h_to_h",
    final_norm="gpt_neox.final_layer_norm",
    lm_head="embed_out",
)


def config(hf: Any, architecture: str) -> ModelConfig:
    bias = bool(getattr(hf, "attention_bias", True))
    return base_config(
        hf,
        architecture,
        norm=NormSpec(NormKind.LAYER, float(hf.layer_norm_eps), bias=True),
        attention=AttentionSpec(bias, bias, rotary_dim=rotary_dim(hf)),
        mlp=MlpSpec(activation(hf.hidden_act), gated=False, bias=True),
        block=BlockSpec(parallel=bool(hf.use_parallel_residual)),
        names=NAMES,
    )
