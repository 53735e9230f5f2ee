"""GLM-4.5 / GLM-4-MoE: partial rotary over the first half of each head, optional per-head
q/k norm and q/k/v biases; dense MLPs on the first ``first_k_dense_replace`` layers, then
mixtures of SiLU-gated experts routed DeepSeek-V3's way (sigmoid scores plus a correction
bias pick the top-k within the best groups; weights renormalised and scaled by
``routed_scaling_factor``) beside always-on shared experts, ungated."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import (
    activation,
    base_config,
    grouped_sigmoid_moe,
    rotary_dim,
)
from genserve.model.spec import (
    Activation,
    AttentionSpec,
    MlpSpec,
    ModelConfig,
    NormSpec,
    QKNorm,
    UnsupportedModelError,
)

ARCHITECTURES = ("Glm4MoeForCausalLM",)


def config(hf: Any, architecture: str) -> ModelConfig:
    if activation(hf.hidden_act) is not Activation.SILU:
        raise UnsupportedModelError(f"GLM-4-MoE experts with {hf.hidden_act!r}: only SiLU")
    norm = NormSpec(eps=float(hf.rms_norm_eps))
    bias = bool(getattr(hf, "attention_bias", False))
    qk_norm = QKNorm.PER_HEAD if getattr(hf, "use_qk_norm", False) else QKNorm.NONE
    moe = grouped_sigmoid_moe(hf)
    return base_config(
        hf,
        architecture,
        norm=norm,
        attention=AttentionSpec(
            qkv_bias=bias, qk_norm=qk_norm, qk_norm_spec=norm, rotary_dim=rotary_dim(hf)
        ),
        mlp=MlpSpec(Activation.SILU),
        moe=moe,
    )
