"""Tiny random-weight checkpoints of non-Llama families written as ``.gguf`` files the way
llama.cpp's ``convert_hf_to_gguf.py`` writes them, for tests of GGUF loading and serving.

Per architecture (llama.cpp's ``conversion/{qwen,gemma,phi}.py`` and gguf-py's tensor map):

* ``qwen2`` / ``qwen3``: the common hyperparameters, ``attention.key_length`` when the
  config names a ``head_dim``, Q/K rows in Hugging Face order, Qwen3's ``attn_q_norm`` /
  ``attn_k_norm``.
* ``gemma2`` / ``gemma3``: every ``*norm.weight`` stored as ``w + 1``; four norms per layer
  (``attn_norm``, ``post_attention_norm``, ``ffn_norm`` = pre-feedforward, ``post_ffw_norm``);
  ``attn_logit_softcapping`` / ``final_logit_softcapping`` / ``attention.sliding_window``.
* ``phi3``: the fused ``attn_qkv`` and ``ffn_up`` (= ``gate_up_proj``),
  ``rope.dimension_count`` (partial rotary), ``rope.scaling.original_context_length``,
  ``attention.sliding_window``.
* Mistral is written as ``llama`` (Q/K permuted): :mod:`genserve.testing.tiny_gguf`.

Tensors are float32 (the comparison is against transformers on the same float weights); the
tokenizer is the embedded default model's (``tiny_gguf``).

    python -m genserve.testing.family_gguf OUT.gguf --family qwen3
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from genserve.testing.tiny_gguf import _copy_tokenizer

# family (tiny_model name) -> GGUF architecture
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
             "phi3": "phi3"}  # fmt: skip

_COMMON = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_PER_ARCH: dict[str, dict[str, str]] = {
    "gemma2": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
}
_PER_ARCH["gemma3"] = _PER_ARCH["gemma2"]


def gguf_tensor_name(hf_name: str, arch: str) -> str:
    """llama.cpp's name of Hugging Face tensor ``hf_name`` in a GGUF of ``arch``."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = {**_COMMON, **_PER_ARCH.get(arch, {})}
    return f"blk.{layer}.{names[module]}.{suffix}"


def _add_hparams(writer: Any, arch: str, config: Mapping[str, Any]) -> None:
    from gguf import RopeScalingType

    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    if "head_dim" in config:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        global_rope = rope.get("full_attention", rope)
        writer.add_rope_freq_base(float(global_rope.get("rope_theta", 10000.0)))
        if config.get("attn_logit_softcapping") is not None:
            writer.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        if config.get("final_logit_softcapping") is not None:
            writer.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        writer.add_sliding_window(config["sliding_window"])
        if arch == "gemma3":  # TextModel's rope keys, which Gemma 3's converter calls first
            if global_rope.get("rope_type") == "linear" and global_rope.get("factor"):
                writer.add_rope_scaling_type(RopeScalingType.LINEAR)
                writer.add_rope_scaling_factor(float(global_rope["factor"]))
            local = rope.get("sliding_attention", {}).get("rope_theta")
            if local is not None:
                writer.add_rope_freq_base_swa(float(local))
        return
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    if arch == "phi3":
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
        writer.add_rope_dimension_count(int(factor * config["hidden_size"]) // heads)
        original = rope.get("original_max_position_embeddings") or config.get(
            "original_max_position_embeddings", config["max_position_embeddings"]
        )
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_sliding_window(config.get("sliding_window") or 0)  # 0: none (Phi-4)
        if rope.get("long_factor"):  # 128k models: the factors as tensors, and the attention
            # factor llama.cpp computes (transformers derives the same from the lengths)
            scale = config["max_position_embeddings"] / original
            attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
            writer.add_rope_scaling_attn_factors(attn)
            for kind in ("long", "short"):
                factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
                writer.add_tensor(f"rope_factors_{kind}.weight", factors)


def write_family_gguf(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    arch: str,
    config: Mapping[str, Any],
    tokenizer_gguf: Path,
) -> Path:
    """Write ``tensors`` (Hugging Face names) of a ``config`` checkpoint as llama.cpp's
    converter writes a GGUF of ``arch`` (float32 tensors)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(path, arch)
    _add_hparams(writer, arch, config)
    _copy_tokenizer(writer, tokenizer_gguf)
    for hf, array in tensors.items():
        w = np.ascontiguousarray(array, dtype=np.float32)
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            w = w + np.float32(1.0)  # Gemma's (1 + w) norm, as llama.cpp stores it
        writer.add_tensor(gguf_tensor_name(hf, arch), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_family_gguf(path: Path, model_dir: Path, family: str) -> Path:
    """The ``make_tiny_model`` checkpoint in ``model_dir`` (family ``family``) as a GGUF."""
    from safetensors.numpy import load_file

    from genserve.model.loader import default_gguf_path

    if family not in GGUF_ARCH:
        raise ValueError(f"no GGUF writer for {family!r}; choose from {', '.join(GGUF_ARCH)}")
    config = json.loads((model_dir / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_family_gguf(path, tensors, GGUF_ARCH[family], config, default_gguf_path())


def main(argv: list[str] | None = None) -> None:
    from genserve.testing.tiny_model import make_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--family", choices=sorted(GGUF_ARCH), required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp), args.family, args.seed)
        print(make_family_gguf(args.out, model_dir, args.family))


if __name__ == "__main__":
    main()
