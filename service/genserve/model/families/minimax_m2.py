"""MiniMax-M2: attention with a full-width q/k RMSNorm (one weight over every head's
features, before the rotary) and partial rotary; every MLP a mixture of SiLU-gated experts
(``block_sparse_moe.experts.{e}.w1/w3/w2``, as Mixtral names them) chosen by sigmoid scores
plus a correction bias, no groups, weighted by the plain sigmoid scores renormalised to 1."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config, rotary_dim
from genserve.model.spec import (
    Activation,
    AttentionSpec,
    MlpSpec,
    ModelConfig,
    MoeNames,
    MoeSpec,
    NormSpec,
    QKNorm,
    RouterSpec,
    Scoring,
    UnsupportedModelError,
)

ARCHITECTURES = ("MiniMaxM2ForCausalLM",)

# As the released checkpoints (and transformers' save_pretrained) name them; transformers
# stacks them into mlp.experts.gate_up_proj only in memory.
_NAMES = MoeNames(
    router="block_sparse_moe.gate",
    correction_bias="block_sparse_moe.e_score_correction_bias",
    experts="block_sparse_moe.experts",
    gate="w1",
    up="w3",
    down="w2",
)


def config(hf: Any, architecture: str) -> ModelConfig:
    if activation(hf.hidden_act) is not Activation.SILU:
        raise UnsupportedModelError(f"MiniMax-M2 experts with {hf.hidden_act!r}: only SiLU")
    norm = NormSpec(eps=float(hf.rms_norm_eps))
    router = RouterSpec(
        int(hf.num_local_experts),
        int(hf.num_experts_per_tok),
        Scoring.SIGMOID,
        renormalize=True,
        correction_bias=True,
    )
    layers = int(hf.num_hidden_layers)
    return base_config(
        hf,
        architecture,
        norm=norm,
        attention=AttentionSpec(
            qk_norm=QKNorm.FULL_WIDTH, qk_norm_spec=norm, rotary_dim=rotary_dim(hf)
        ),
        mlp=MlpSpec(Activation.SILU),
        moe=MoeSpec(router, int(hf.intermediate_size), (True,) * layers, names=_NAMES),
    )
