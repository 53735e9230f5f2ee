"""Tiny random-weight Qwen2-MoE / Qwen3-MoE / Mixtral checkpoints written as ``.gguf`` files
the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (``conversion/qwen.py``'s
``Qwen2MoeModel``, ``conversion/llama.py``'s ``LlamaModel``): each layer's experts stacked
into ``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``,
the router as ``ffn_gate_inp``, Qwen2-MoE's shared expert as ``ffn_*_shexp`` with its gate
``ffn_gate_inp_shexp``, and the ``expert_count`` / ``expert_used_count`` /
``expert_feed_forward_length`` / ``expert_shared_feed_forward_length`` keys.  Mixtral is
written as architecture ``llama``, as the converter writes it: Q/K rows permuted for
llama.cpp's rotary layout, ``rope.dimension_count``, the expert width only as
``feed_forward_length``.  For tests of GGUF mixture-of-experts loading.

The experts take the preset's type: F32 (the comparison is then against transformers on
the checkpoint itself), Q8_0 / Q4_0 (gguf-py's own quantizers), or K-quants (random valid
blocks: gguf-py 0.19 has no K-quant quantizer).  Router, norms and biases stay F32, as
``llama-quantize`` leaves them.  :func:`write_moe_gguf` also writes the *reference*
checkpoint (:mod:`genserve.testing.gguf_reference`): the Hugging Face directory with every
weight replaced by what gguf-py dequantizes from the file, which is what the served model
must compute with.

    python -m genserve.testing.moe_gguf OUT.gguf MODEL_DIR [--experts Q8_0]
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from genserve.testing import gguf_reference
from genserve.testing.gguf_reference import add_tensor, finish_gguf, float_tensors, write_reference
from genserve.testing.tiny_gguf import _copy_tokenizer

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_PER_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)
# Mixtral's expert names, as the projections they are.
_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}
_STACK = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
# Expert presets that mix types per projection, as llama-quantize's Q4_K_M does.
EXPERT_MIXES = {"Q4_K_M": {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}}


def _gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_PER_LAYER[module]}.{suffix}"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation for its rotary layout (``LlamaModel.permute``)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _hparams(writer: Any, config: Mapping[str, Any], arch: str) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_vocab_size(config["vocab_size"])
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if arch == "llama":  # LlamaModel: the rotary width; Mixtral's expert width is n_ff
        writer.add_rope_dimension_count(head_dim)
    elif config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_expert_count(config.get("num_experts") or config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if config.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def write_moe_gguf(
    path: Path, model_dir: Path, expert_type: str = "F32", matrix_type: str = "F32"
) -> tuple[Path, Path]:
    """``model_dir`` (a Qwen2/3-MoE or Mixtral checkpoint, per-expert tensors) as a GGUF at
    ``path``,
    its routed experts in ``expert_type`` (a GGML type, or a key of :data:`EXPERT_MIXES`)
    and its other matrices (attention, shared expert, embedding, head) in ``matrix_type``;
    returns ``(path, reference_dir)``, the reference being ``model_dir``'s checkpoint
    with every weight as gguf-py dequantizes it from the file (beside ``path``, named
    ``{stem}-reference``)."""
    from gguf import GGUFWriter

    from genserve.model.loader import default_gguf_path

    config = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[config["model_type"]]
    tensors = float_tensors(model_dir)
    # (layer, projection) -> {expert: (HF name, matrix)}
    stacks: dict[tuple[int, str], dict[int, tuple[str, np.ndarray]]] = {}
    plain: dict[str, np.ndarray] = {}
    for name, array in tensors.items():
        match = _EXPERT.fullmatch(name)
        if match is None:
            plain[name] = np.ascontiguousarray(array)
        else:
            layer, expert = int(match.group(1)), int(match.group(2))
            proj = _PROJ.get(match.group(3), match.group(3).removesuffix("_proj"))
            stacks.setdefault((layer, proj), {})[expert] = (name, array)
    # ``llama``: the converter permutes Q/K rows (the reference keeps Hugging Face's order;
    # rows are independent in every block format, so row order commutes with quantizing).
    row_orders: dict[str, np.ndarray] = {}
    if arch == "llama":
        heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        for name, w in plain.items():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                n = heads if "q_proj" in name else kv_heads
                row_orders[name] = _permute(np.arange(w.shape[0]), n)

    writer = GGUFWriter(path, arch)
    _hparams(writer, config, arch)
    _copy_tokenizer(writer, default_gguf_path())
    reference: dict[str, np.ndarray] = {}
    for name, w in plain.items():
        gguf = _gguf_name(name)
        is_matrix = w.ndim == 2 and "ffn_gate_inp" not in gguf
        order = row_orders.get(name)
        if order is None:
            reference[name] = add_tensor(writer, gguf, w, matrix_type if is_matrix else "F32")
        else:  # file row i is HF row order[i]
            reference[name] = np.empty_like(w)
            reference[name][order] = add_tensor(writer, gguf, w[order], matrix_type)
    for (layer, proj), experts in sorted(stacks.items()):
        stacked = np.stack([experts[e][1] for e in sorted(experts)])  # [E, rows, cols]
        qtype = EXPERT_MIXES.get(expert_type, {}).get(proj, expert_type)
        values = add_tensor(writer, f"blk.{layer}.{_STACK[proj]}.weight", stacked, qtype)
        for e in sorted(experts):
            reference[experts[e][0]] = values[e]
    finish_gguf(writer)
    return path, write_reference(path, model_dir, reference)


def main(argv: list[str] | None = None) -> None:
    gguf_reference.main(write_moe_gguf, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()
