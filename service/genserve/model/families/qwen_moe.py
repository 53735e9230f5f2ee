"""Qwen2-MoE and Qwen3-MoE: Qwen2's (q/k/v biases) or Qwen3's (per-head q/k norm) attention,
MLPs that are mixtures of SiLU-gated experts chosen by softmax top-k (renormalised when
``norm_topk_prob``) on the layers ``decoder_sparse_step`` and ``mlp_only_layers`` select, a
dense MLP elsewhere; Qwen2-MoE adds a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import activation, base_config
from genserve.model.spec import (
    Activation,
    AttentionSpec,
    MlpSpec,
    ModelConfig,
    MoeSpec,
    NormSpec,
    QKNorm,
    RouterSpec,
    UnsupportedModelError,
)

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def moe_layers(hf: Any) -> tuple[bool, ...]:
    """Per layer, whether transformers builds its MLP as the sparse MoE block."""
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    experts = int(hf.num_experts)
    return tuple(
        i not in dense and experts > 0 and (i + 1) % step == 0
        for i in range(int(hf.num_hidden_layers))
    )


def config(hf: Any, architecture: str) -> ModelConfig:
    if activation(hf.hidden_act) is not Activation.SILU:
        raise UnsupportedModelError(f"Qwen MoE experts with {hf.hidden_act!r}: only SiLU")
    norm = NormSpec(eps=float(hf.rms_norm_eps))
    if architecture == "Qwen2MoeForCausalLM":
        attention = AttentionSpec(qkv_bias=bool(getattr(hf, "qkv_bias", True)))
        shared = int(getattr(hf, "shared_expert_intermediate_size", 0) or 0)
    else:
        bias = bool(getattr(hf, "attention_bias", False))
        attention = AttentionSpec(bias, bias, qk_norm=QKNorm.PER_HEAD, qk_norm_spec=norm)
        shared = 0
    router = RouterSpec(
        int(hf.num_experts), int(hf.num_experts_per_tok), renormalize=bool(hf.norm_topk_prob)
    )
    moe = MoeSpec(
        router,
        int(hf.moe_intermediate_size),
        moe_layers(hf),
        shared_intermediate_size=shared,
        shared_gate=shared > 0,
    )
    return base_config(
        hf, architecture, norm=norm, attention=attention, mlp=MlpSpec(Activation.SILU), moe=moe
    )
