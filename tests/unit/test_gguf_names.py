"""llama.cpp's per-architecture GGUF tensor names map back to the Hugging Face names the
native families load, and round-trip with the test writer's (``testing/family_gguf``)."""

from __future__ import annotations

import pytest

from genserve.model import gguf_names
from genserve.testing.family_gguf import gguf_tensor_name


@pytest.mark.parametrize(
    ("arch", "gguf", "hf"),
    [
        ("llama", "blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("gemma2", "blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
        (
            "gemma2",
            "blk.0.post_attention_norm.weight",
            "model.layers.0.post_attention_layernorm.weight",
        ),
        (
            "gemma3",
            "blk.1.post_ffw_norm.weight",
            "model.layers.1.post_feedforward_layernorm.weight",
        ),
        ("qwen3", "blk.2.attn_k_norm.weight", "model.layers.2.self_attn.k_norm.weight"),
        ("qwen2", "blk.2.attn_q.bias", "model.layers.2.self_attn.q_proj.bias"),
        ("phi3", "blk.0.attn_qkv.weight", "model.layers.0.self_attn.qkv_proj.weight"),
        ("phi3", "blk.0.ffn_up.weight", "model.layers.0.mlp.gate_up_proj.weight"),
        ("qwen3", "output_norm.weight", "model.norm.weight"),
        ("phi3", "rope_factors_long.weight", None),  # config, not a weight (gguf_config)
    ],
)
def test_gguf_names_map_to_hugging_face(arch: str, gguf: str, hf: str | None) -> None:
    assert gguf_names.hf_tensor_name(gguf, arch) == hf
    if hf is not None and arch != "llama":
        assert gguf_tensor_name(hf, arch) == gguf  # the test writer names it as llama.cpp


def test_conventions_per_architecture() -> None:
    assert gguf_names.LAYOUTS["llama"].permuted_qk
    assert not any(gguf_names.LAYOUTS[a].permuted_qk for a in ("qwen2", "qwen3", "phi3", "gemma2"))
    assert gguf_names.norm_shift("blk.0.attn_q_norm.weight", "gemma3") == 1.0
    assert gguf_names.norm_shift("output_norm.weight", "gemma2") == 1.0
    assert gguf_names.norm_shift("blk.0.attn_q.weight", "gemma2") == 0.0
    assert gguf_names.norm_shift("blk.0.attn_norm.weight", "qwen3") == 0.0
    assert gguf_names.layout("gpt2") is None
    # Matrices only (the quantized path): norms are not matrices.
    assert gguf_names.hf_matrix_name("blk.0.attn_norm.weight", "qwen3") is None
    assert gguf_names.hf_matrix_name("blk.0.attn_qkv.weight", "phi3") is not None
