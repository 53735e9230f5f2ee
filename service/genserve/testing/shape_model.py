"""Random-weight models with the real shapes of popular checkpoints, for GPU benchmarks on
machines with no network (#12): throughput and latency do not depend on the weights' values.

    genserve-bench --make-model llama-3.1-8b-shape DIR [--device cuda] [--vocab 49152]

The tokenizer is the embedded default model's (SmolLM2, vocabulary 49152, what the issue's
measurements used); the real Llama-3 vocabulary (128256) needs its tokenizer, which is not
available offline, so ``vocab_size`` defaults to the tokenizer's.  Weights are written in
bfloat16 (a float32 8B shape would be 32 GB); both genserve and transformers load them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Dimensions from the published config.json files (Llama-3 rope scaling left out: it changes
# no shape or cost).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b-shape": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
    "llama-3.1-8b-shape": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
    },
    # For unit tests: the same code path at a size a CPU builds in a second.
    "tiny-shape": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
}


# Shapes of other families, as (transformers model_type, config fields): docs/models/moe.md's
# benchmark files.  Qwen3-30B-A3B cut to 4 of its 48 layers (128 experts, top-8, expert width
# 768, 32 query / 4 KV heads of 128, its 151,936 vocabulary), and the dense Qwen3 with the
# same active parameters (one MLP of 8 x 768 = 6,144).
_QWEN3_A3B: dict[str, Any] = {
    "hidden_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "intermediate_size": 6144,
}
TYPED_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b-4l-shape": (
        "qwen3_moe",
        {
            **_QWEN3_A3B,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    "qwen3-a3b-dense-4l-shape": ("qwen3", dict(_QWEN3_A3B)),
}


def make_shape_model(
    shape: str,
    out_dir: Path,
    *,
    device: str = "cpu",
    dtype: str = "bfloat16",
    vocab_size: int | None = None,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write a random-weight ``shape`` model (config.json, safetensors, tokenizer) to
    ``out_dir``.  ``device="cuda"`` initialises on the GPU (seconds instead of minutes for
    8B)."""
    from genserve.testing.tiny_model import make_tiny_model

    if shape in TYPED_SHAPES:
        model_type, typed = TYPED_SHAPES[shape]
        vocab = {} if vocab_size is None else {"vocab_size": vocab_size}
        return _make_typed(
            out_dir, model_type, {**typed, **vocab}, dtype, device, seed, tokenizer_dir
        )
    if shape not in SHAPES:
        names = ", ".join([*SHAPES, *TYPED_SHAPES])
        raise ValueError(f"unknown shape {shape!r}; choose from {names}")
    fields: dict[str, Any] = dict(SHAPES[shape])
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields["initializer_range"] = 0.02 if shape != "tiny-shape" else 0.2
    return make_tiny_model(
        out_dir,
        "llama",
        seed,
        tokenizer_dir=tokenizer_dir,
        dtype=dtype,
        device=device,
        **fields,
    )


def _make_typed(
    out_dir: Path,
    model_type: str,
    fields: dict[str, Any],
    dtype: str,
    device: str,
    seed: int,
    tokenizer_dir: Path | None,
) -> Path:
    """A ``model_type`` model with ``fields`` and transformers' own initialisation (a
    benchmark model: its values do not matter, its shape does), beside the embedded
    tokenizer; the vocabulary is the field's (larger than the tokenizer's for Qwen3)."""
    from transformers import AutoTokenizer

    from genserve.testing.tiny_model import default_tokenizer_dir, random_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir or default_tokenizer_dir()))
    model = random_causal_lm(model_type, fields, tokenizer, seed, device, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
