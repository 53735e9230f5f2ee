"""Tiny random-weight mixture-of-experts checkpoints of the natively served MoE families.

Each is 2 layers, hidden 64, 8 experts of which each token takes 2 (so routing decides
which quarter of the experts a token sees), saved by transformers' ``save_pretrained``
(float32) beside the default model's tokenizer.  Every parameter is random (vectors around
their initial value, matrices from N(0, 0.2)), and so is the routing correction bias of GLM
and MiniMax-M2 (a buffer transformers initialises to 0, under which a router that ignored it
would agree); gpt-oss's sink logits are drawn around 1 so that they take a visible share of
each softmax.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.fallback_models import WINDOW, randomize

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "num_experts_per_tok": 2,
}

MOE_FAMILIES: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "intermediate_size": 48, "sliding_window": WINDOW},
    # Layer 0 dense (mlp_only_layers), layer 1 MoE; renormalised top-k.
    "qwen3_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "mlp_only_layers": [0],
    },
    # Not renormalised, with the gated shared expert.
    "qwen2_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "shared_expert_intermediate_size": 48,
        "qkv_bias": True,
    },
    # Sigmoid routing with the correction bias, 2 groups of which the best 1 is searched,
    # scaled weights, an ungated shared expert, a first dense layer, partial rotary, q/k norm.
    "glm4_moe": {
        "n_routed_experts": 8,
        "moe_intermediate_size": 32,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    # Sliding and full layers alternating (the window shorter than the long prompts), sinks,
    # an affine router weighing its top-k by a softmax over them, clamped SwiGLU experts with
    # biases (a limit low enough that random activations reach it), YaRN rotary.
    "gpt_oss": {
        "num_local_experts": 8,
        "intermediate_size": 32,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "swiglu_limit": 1.5,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 512,
        },
    },
    # Sigmoid routing with the correction bias, no groups; full-width q/k norm with partial
    # rotary over half of each head.
    "minimax_m2": {
        "num_local_experts": 8,
        "intermediate_size": 32,
        "rotary_dim": 8,
    },
}


def make_moe_model(
    out_dir: Path, model_type: str, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """Write ``model_type``'s tiny MoE checkpoint and the tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    fields = {**_BASE, **MOE_FAMILIES[model_type], **overrides}
    fields.setdefault("vocab_size", len(tokenizer))
    config = AutoConfig.for_model(
        model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # GLM-4, MiniMax-M2
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
        for name, param in model.named_parameters():
            if name.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a visible share
                param.copy_(1.5 * torch.randn(param.shape, generator=gen) + 1.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
