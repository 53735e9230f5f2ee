"""gpt-oss: attention with q/k/v and o biases and a learned sink logit per head, sliding and
full layers alternating (``layer_types``), YaRN rotary; every MLP a mixture of experts whose
router is affine (a bias) and weighs its top-k logits by a softmax over those k, each expert
a clamped SwiGLU with biases, stacked transposed with gate and up columns interleaved (or, in
the released checkpoints, MXFP4 blocks and scales: ``model/mxfp4.py``)."""

from __future__ import annotations

from typing import Any

from genserve.model.families.common import base_config
from genserve.model.spec import (
    AttentionSpec,
    ClampedSwiGLU,
    ModelConfig,
    MoeNames,
    MoeSpec,
    NormSpec,
    RouterSpec,
    Scoring,
    UnsupportedModelError,
)

ARCHITECTURES = ("GptOssForCausalLM",)

_NAMES = MoeNames(router="mlp.router", experts="mlp.experts", interleaved_gate_up=True)


def config(hf: Any, architecture: str) -> ModelConfig:
    quantization = getattr(hf, "quantization_config", None)
    if quantization:
        # The released checkpoints keep experts as MXFP4 blocks and scales: rearranged into
        # GGML's MXFP4 blocks at load (model/mxfp4.py) and served by the quantized expert op.
        method = quantization.get("quant_method") if isinstance(quantization, dict) else "?"
        if method != "mxfp4":
            raise UnsupportedModelError(
                f"gpt-oss experts quantized as {method!r}: not read natively"
            )
    bias = bool(getattr(hf, "attention_bias", True))
    layers = int(hf.num_hidden_layers)
    router = RouterSpec(
        int(hf.num_local_experts), int(hf.num_experts_per_tok), Scoring.TOPK_SOFTMAX, bias=True
    )
    moe = MoeSpec(
        router,
        int(hf.intermediate_size),
        (True,) * layers,
        names=_NAMES,
        activation=ClampedSwiGLU(float(hf.swiglu_alpha), float(hf.swiglu_limit)),
        expert_bias=True,
    )
    return base_config(
        hf,
        architecture,
        norm=NormSpec(eps=float(hf.rms_norm_eps)),
        attention=AttentionSpec(qkv_bias=bias, o_bias=bias, sinks=True),
        moe=moe,
    )
