"""Mixtral: Mistral's attention with every MLP a mixture of SiLU-gated experts, chosen by
softmax top-k and renormalised (``block_sparse_moe``; experts named ``w1``/``w3``/``w2``)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import (
    Activation,
    MlpSpec,
    ModelConfig,
    MoeNames,
    MoeSpec,
    NormSpec,
    RouterSpec,
    UnsupportedModelError,
)

ARCHITECTURES = ("MixtralForCausalLM",)

_NAMES = MoeNames(
    router="block_sparse_moe.gate",
    experts="block_sparse_moe.experts",
    gate="w1",
    up="w3",
    down="w2",
)


def config(hf: Any, architecture: str) -> ModelConfig:
    if activation(hf.hidden_act) is not Activation.SILU:
        raise UnsupportedModelError(f"Mixtral experts with {hf.hidden_act!r}: only SiLU")
    layers = int(hf.num_hidden_layers)
    router = RouterSpec(int(hf.num_local_experts), int(hf.num_experts_per_tok), renormalize=True)
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        mlp=MlpSpec(Activation.SILU),
        moe=MoeSpec(router, int(hf.intermediate_size), (True,) * layers, names=_NAMES),
    )
