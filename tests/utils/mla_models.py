"""Tiny random-weight DeepSeek-V3 checkpoints (multi-head latent attention, issue #26).

3 layers (the first dense: ``first_k_dense_replace``), hidden 64, 4 heads; latent rank 32,
rope width 16 (interleaved, DeepSeek's layout), nope width 16, value width 24 (unlike the key
width, so a mix-up of the two cannot pass); 8 routed experts in 2 groups of which the best 1
is searched, top-2, one shared expert.  Saved by transformers' ``save_pretrained`` (float32)
beside the default model's tokenizer.  Every parameter random (``randomize``), the routing
correction bias too.  Variants: ``deepseek_v3`` compresses queries (``q_lora_rank`` 24) and
scales its rope with YaRN (so the softmax scale carries ``mscale²``); ``deepseek_v3_q_proj``
has no query compression (``q_proj``), default rope and biases on the q_a/kv_a/o projections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.e2e.fallback_models import randomize

_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 2048,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
}

MLA_VARIANTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "q_lora_rank": 24,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 512,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    "deepseek_v3_q_proj": {"q_lora_rank": None, "attention_bias": True},
}


def make_mla_model(
    out_dir: Path, variant: str, tokenizer_dir: Path, seed: int = 0, **overrides: Any
) -> Path:
    """Write ``variant``'s tiny DeepSeek-V3 checkpoint and the tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    fields = {**_BASE, **MLA_VARIANTS[variant], **overrides}
    fields.setdefault("vocab_size", len(tokenizer))
    config = AutoConfig.for_model(
        "deepseek_v3",
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
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=gen))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
