"""DeepSeek-V3 (and Kimi-K2, which ships as ``DeepseekV3ForCausalLM``): multi-head latent
attention (``spec.MlaSpec``, ``model/mla.py``) in every layer, dense SiLU MLPs on the first
``first_k_dense_replace`` layers, then DeepSeek's grouped sigmoid-routed experts beside
ungated shared experts (``common.grouped_sigmoid_moe``, as GLM-4.5)."""

from __future__ import annotations

import math
from typing import Any

from genserve.model.families.common import activation, base_config, grouped_sigmoid_moe
from genserve.model.spec import (
    Activation,
    AttentionSpec,
    MlaSpec,
    MlpSpec,
    ModelConfig,
    NormSpec,
    UnsupportedModelError,
)

ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def softmax_scale(hf: Any, qk_head_dim: int) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when the
    rope is scaled and names ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale: float = qk_head_dim**-0.5
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim") or 0
    factor = float(params.get("factor") or 1.0)
    if kind != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def config(hf: Any, architecture: str) -> ModelConfig:
    if activation(hf.hidden_act) is not Activation.SILU:
        raise UnsupportedModelError(f"DeepSeek-V3 MLPs with {hf.hidden_act!r}: only SiLU")
    quantized = getattr(hf, "quantization_config", None)
    if quantized:
        # DeepSeek's own checkpoints are FP8 blocks with per-block scales (weight_scale_inv):
        # read as plain weights they would be wrong, so they go to the fallback.
        method = dict(quantized).get("quant_method", "?")
        raise UnsupportedModelError(
            f"DeepSeek-V3 checkpoint quantized as {method!r}: the native path reads "
            "unquantized (bfloat16/float) weights"
        )
    q_lora_rank = getattr(hf, "q_lora_rank", None)
    mla = MlaSpec(
        kv_lora_rank=int(hf.kv_lora_rank),
        qk_nope_head_dim=int(hf.qk_nope_head_dim),
        qk_rope_head_dim=int(hf.qk_rope_head_dim),
        v_head_dim=int(hf.v_head_dim),
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        bias=bool(getattr(hf, "attention_bias", False)),
        interleaved_rope=bool(getattr(hf, "rope_interleave", True)),
    )
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        # The rotary embedding rotates the rope features only; the cache holds one latent row.
        head_dim=mla.qk_rope_head_dim,
        num_kv_heads=1,
        attention=AttentionSpec(scale=softmax_scale(hf, mla.qk_head_dim)),
        mlp=MlpSpec(Activation.SILU),
        moe=grouped_sigmoid_moe(hf),
        mla=mla,
    )
