"""Tiny random-weight models of every native family for tests (and for client tests that
need a real server): a few layers, hidden size 64, grouped-query attention, saved with
transformers' ``save_pretrained`` (safetensors) next to the embedded default model's
tokenizer, so prompts tokenize exactly as they would for the real model (vocabulary 49152).

    python -m genserve.testing.tiny_model OUT_DIR [--arch llama|mistral|qwen2|...] [--seed N]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

# Families beyond the first three: each config sets the family's own features to values
# that matter at this size (short sliding windows, strong soft-caps, scaled rotary with a
# short original context, multipliers far from 1), and every norm weight and bias is
# randomized (transformers initialises them to 1/0, which would hide a skipped one).
_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + i / 8 for i in range(6)],
    "long_factor": [2.0 + i / 2 for i in range(6)],
    "partial_rotary_factor": 0.75,
}
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"tie_word_embeddings": False}),
    "qwen2-yarn": (
        "qwen2",
        {
            "use_sliding_window": False,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "gemma": ("gemma", {"hidden_act": "gelu_pytorch_tanh"}),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 6.0,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
            },
        },
    ),
    "phi3": (
        "phi3",
        # 128: the test prompts are either longer from the start or stay shorter while they
        # generate (see docs/models/architectures.md on crossing it).
        {"original_max_position_embeddings": 128, "rope_parameters": _LONGROPE},
    ),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.4,
            "attention_multiplier": 0.15,
            "logits_scaling": 2.5,
            "attention_bias": True,
        },
    ),
    "olmo2": ("olmo2", {}),
    "stablelm": (
        "stablelm",
        {
            "use_qkv_bias": True,
            "layer_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
    "phi": (
        "phi",
        {
            "num_key_value_heads": 4,
            "hidden_act": "gelu_new",
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        },
    ),
    "gpt_neox": (
        "gpt_neox",
        {
            "num_key_value_heads": 4,
            "hidden_act": "gelu",
            "use_parallel_residual": True,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
    "starcoder2": (
        "starcoder2",
        {"sliding_window": 32, "use_bias": True, "hidden_act": "gelu_pytorch_tanh"},
    ),
    "cohere": ("cohere", {"use_qk_norm": True, "logit_scale": 0.5, "layer_norm_eps": 1e-5}),
    "smollm3": (
        "smollm3",
        {"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "tie_word_embeddings": False},
    ),
}
NATIVE_FAMILIES = tuple(FAMILY_CONFIGS)

ARCHITECTURES = ("llama", "mistral", "qwen2", *NATIVE_FAMILIES)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    # transformers' default (0.02) makes a model this small repeat one token forever (its
    # residual stream is all embedding); 0.2 gives varied greedy continuations, so tests
    # comparing generations actually test something.
    "initializer_range": 0.2,
}
# Each architecture also exercises a feature of its own: llama ties the embeddings (as
# SmolLM2 does), mistral has a sliding window shorter than the test prompts, qwen2 has
# Q/K/V biases.
_PER_ARCH: dict[str, dict[str, Any]] = {
    "llama": {"tie_word_embeddings": True},
    "mistral": {"tie_word_embeddings": False, "sliding_window": 32},
    "qwen2": {"tie_word_embeddings": False, "use_sliding_window": False},
}


def default_tokenizer_dir() -> Path:
    """The converted embedded default model (converted once and cached, like the server),
    or ``$GENSERVE_TOKENIZER_DIR`` when set: a directory holding that tokenizer's files, for
    machines without the embedded model's package (the GPU machine: scripts/gpu-check.sh)."""
    override = os.environ.get("GENSERVE_TOKENIZER_DIR")
    if override:
        return Path(override)
    from genserve.config import load_config
    from genserve.model.loader import resolve_model

    config = load_config([])
    return resolve_model(None, cache_dir=config.genserve_cache / "models").local_dir


def make_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    tokenizer_dir: Path | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    **overrides: Any,
) -> Path:
    """Write a random-weight ``arch`` model (float32) and a tokenizer into ``out_dir``.

    ``overrides`` replace config fields (e.g. ``num_attention_heads=6,
    num_key_value_heads=3, hidden_size=96`` for tensor-parallel tests — transformers wants
    the hidden size divisible by the head count —, or ``rope_parameters={...}``).
    ``tokenizer_dir`` defaults to the embedded default model.  ``dtype``/``device``: how the
    weights are initialised and saved (real-shape models: bfloat16 on CUDA).  Returns
    ``out_dir``.
    """
    from transformers import AutoTokenizer

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHITECTURES)}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or default_tokenizer_dir()))
    model_type, family = FAMILY_CONFIGS.get(arch, (arch, {}))
    fields = {**_COMMON, **_PER_ARCH.get(arch, {}), **family, **overrides}
    fields.setdefault("vocab_size", len(tokenizer))
    model = random_causal_lm(model_type, fields, tokenizer, seed, device, dtype)
    if arch in FAMILY_CONFIGS:
        _randomize_norms_and_biases(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def random_causal_lm(
    model_type: str, fields: dict[str, Any], tokenizer: Any, seed: int, device: str, dtype: str
) -> Any:
    """A ``model_type`` causal LM with config ``fields`` and transformers' own random
    initialisation (seeded), its special-token ids the tokenizer's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


def _randomize_norms_and_biases(model: Any, seed: int) -> None:
    """Norm weights around 1 and biases around 0, each different (see FAMILY_CONFIGS)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen).to(param.dtype) * 0.2
            if name.endswith(".bias"):
                param.copy_(noise)
            elif "norm" in name:
                param.copy_(param + noise)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_model(args.out_dir, args.arch, args.seed))


if __name__ == "__main__":
    main()
