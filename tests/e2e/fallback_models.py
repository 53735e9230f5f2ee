"""Tiny random-weight checkpoints of the architectures the transformers fallback serves.

Each is 2 layers, hidden 64, saved by transformers' ``save_pretrained`` (float32) beside the
embedded default model's tokenizer.  Every parameter is randomised: transformers
initialises biases to 0 and norm weights to 1 (or 0 for Gemma's ``1 + w``), under which a
server that skipped them would still agree.  Sliding windows, attention chunks and soft-caps
are small enough that the test prompts cross them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

WINDOW = 16  # sliding window / attention chunk, shorter than the test prompts

_DENSE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}

# model_type → config fields over _DENSE (None: remove the _DENSE field).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3": {"attention_bias": True},
    "gemma2": {
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 3.0,
        "query_pre_attn_scalar": 24,
    },
    "gemma3_text": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 3.0,
    },
    "phi3": {"pad_token_id": 0},
    "phi": {"partial_rotary_factor": 0.5, "qk_layernorm": True},
    "gpt_neox": {"rotary_pct": 0.25, "num_key_value_heads": None, "head_dim": None},
    "falcon": {"num_key_value_heads": None, "head_dim": None, "multi_query": True},
    "olmo2": {},
    "granite": {
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
        "attention_bias": True,
    },
    "stablelm": {"partial_rotary_factor": 0.25, "use_qkv_bias": True, "head_dim": None},
    "starcoder2": {"sliding_window": WINDOW, "use_bias": True},
    "cohere": {"logit_scale": 0.5, "use_qk_norm": True, "head_dim": None},
    "smollm3": {"no_rope_layer_interval": 2},
    "gpt_bigcode": {
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_inner": 128,
        "n_positions": 2048,
        "multi_query": True,
        "hidden_size": None,
        "intermediate_size": None,
        "num_hidden_layers": None,
        "num_attention_heads": None,
        "num_key_value_heads": None,
        "head_dim": None,
        "max_position_embeddings": None,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW},
    "qwen3_moe": {**_MOE, "num_experts": 4, "norm_topk_prob": True},
    "qwen2_moe": {
        **_MOE,
        "num_experts": 4,
        "shared_expert_intermediate_size": 64,
        "qkv_bias": True,
    },
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "deepseek_v3": {
        **_MOE,
        "num_key_value_heads": 4,
        "head_dim": None,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 12,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "first_k_dense_replace": 1,
    },
    "glm4_moe": {
        **_MOE,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "partial_rotary_factor": 0.5,
        "use_qk_norm": True,
        "attention_bias": True,
    },
    "minimax_m2": {"num_local_experts": 4, "num_experts_per_tok": 2, "rotary_dim": 8},
    "llama4_text": {
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "interleave_moe_layer_step": 1,
        "attention_chunk_size": WINDOW,
        "no_rope_layers": [1, 0],
        "attn_temperature_tuning": False,
    },
    "gemma4_text": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
        "hidden_size_per_layer_input": 16,
        "final_logit_softcapping": 3.0,
    },
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "gemma": {"head_dim": 16},
    "ministral3": {"sliding_window": WINDOW},
    # Qwen2.5 with YaRN: the native Qwen2 has no YaRN rope, so it takes the fallback.
    "qwen2": {
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    },
}


def make_fallback_model(
    out_dir: Path, model_type: str, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """Write ``model_type``'s tiny checkpoint (every parameter random) and the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    fields = {**_DENSE, **ARCHITECTURES[model_type], **overrides}
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("vocab_size", len(tokenizer))
    if model_type == "gemma4_text":
        fields.setdefault("vocab_size_per_layer_input", fields["vocab_size"])
    config = AutoConfig.for_model(
        model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def randomize(model: Any, seed: int) -> None:
    """Perturb every parameter: vectors (biases, norm weights, sinks, router biases) by
    N(0, 0.1) around their initial value, matrices re-drawn from N(0, 0.2)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1:
                param.add_(0.1 * noise.to(param.dtype))
            else:
                param.copy_(0.2 * noise.to(param.dtype))
