"""A tiny random-weight gpt-oss checkpoint written as a ``.gguf`` file the way llama.cpp's
``convert_hf_to_gguf.py`` writes one (``conversion/gpt_oss.py``'s ``GptOssModel``):
architecture ``gpt-oss``; the interleaved ``gate_up_proj [E, H, 2I]`` split into
``ffn_gate_exps`` / ``ffn_up_exps`` ``[E, I, H]`` (columns ``2j`` and ``2j + 1``, transposed),
``down_proj [E, I, H]`` transposed into ``ffn_down_exps [E, H, I]``, their biases as
``ffn_{gate,up,down}_exps.bias``; the router as ``ffn_gate_inp`` with its bias, the sinks as
``attn_sinks.weight``, the pre-MLP norm as ``post_attention_norm``; and the keys the converter
writes (``sliding_window``, ``expert_feed_forward_length``, ``key_length``, the YaRN
``rope.scaling.*``).  For tests of gpt-oss GGUF loading.

The experts take the requested type: F32 (the comparison is then against transformers on
the checkpoint itself), Q8_0 or MXFP4 (gguf-py's own quantizers; MXFP4 is what the converter
writes from the released checkpoints and ``llama-quantize ... MXFP4_MOE`` from float ones).
Router, norms, sinks and biases stay F32, as ``llama-quantize`` leaves them.  The *reference*
written beside the file is the Hugging Face checkpoint with every weight as gguf-py
dequantizes it from the file, back in Hugging Face's layout: what the served model must
compute with.

    python -m genserve.testing.gpt_oss_gguf OUT.gguf MODEL_DIR [--experts MXFP4]

:func:`write_gpt_oss_mxfp4_checkpoint` writes the same model in the released Hugging Face
checkpoints' MXFP4 format instead (``*_blocks`` / ``*_scales``, ``quantization_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from genserve.testing import gguf_reference
from genserve.testing.gguf_reference import (
    add_tensor,
    copy_side_files,
    finish_gguf,
    float_tensors,
    write_reference,
)
from genserve.testing.tiny_gguf import _copy_tokenizer

ARCH = "gpt-oss"
_PER_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "lm_head.weight": "output.weight",
    "model.norm.weight": "output_norm.weight",
}


def _hparams(writer: Any, config: dict[str, Any]) -> None:
    """The keys ``GptOssModel.set_gguf_parameters`` writes (base ``TextModel``'s plus the
    window and the expert width)."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":
        from gguf import RopeScalingType

        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(float(rope["factor"]))
        writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        writer.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        writer.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    writer.add_rope_freq_base(float(rope.get("rope_theta", 150000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])


def _gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    _, _, layer, rest = hf.split(".", 3)
    if rest == "self_attn.sinks":
        return f"blk.{layer}.attn_sinks.weight"
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_PER_LAYER[module]}.{suffix}"


def write_gpt_oss_gguf(
    path: Path, model_dir: Path, expert_type: str = "F32", matrix_type: str = "F32"
) -> tuple[Path, Path]:
    """``model_dir`` (a float gpt-oss checkpoint) as a GGUF at ``path``, its routed experts
    in ``expert_type`` (F32, Q8_0 or MXFP4) and its attention, embedding and head matrices
    in ``matrix_type``; returns ``(path, reference_dir)`` (``{stem}-reference`` beside
    ``path``: the checkpoint with the file's dequantized values)."""
    from gguf import GGUFWriter

    from genserve.model.loader import default_gguf_path

    config = json.loads((model_dir / "config.json").read_text())
    tensors = float_tensors(model_dir)
    writer = GGUFWriter(path, ARCH)
    _hparams(writer, config)
    _copy_tokenizer(writer, default_gguf_path())

    reference: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        if ".mlp.experts." in name:
            continue
        is_matrix = w.ndim == 2 and "mlp.router" not in name
        reference[name] = add_tensor(
            writer, _gguf_name(name), w, matrix_type if is_matrix else "F32"
        )
    for layer in range(config["num_hidden_layers"]):
        at = f"model.layers.{layer}.mlp.experts"
        blk = f"blk.{layer}"
        gate_up = tensors[f"{at}.gate_up_proj"].transpose(0, 2, 1)  # [E, 2I, H]
        gate = add_tensor(writer, f"{blk}.ffn_gate_exps.weight", gate_up[:, 0::2], expert_type)
        up = add_tensor(writer, f"{blk}.ffn_up_exps.weight", gate_up[:, 1::2], expert_type)
        down = add_tensor(
            writer,
            f"{blk}.ffn_down_exps.weight",
            tensors[f"{at}.down_proj"].transpose(0, 2, 1),
            expert_type,
        )  # [E, H, I]
        bias = tensors[f"{at}.gate_up_proj_bias"]  # [E, 2I]
        writer.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2]))
        writer.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))
        writer.add_tensor(f"{blk}.ffn_down_exps.bias", tensors[f"{at}.down_proj_bias"])
        merged = np.empty_like(gate_up)
        merged[:, 0::2], merged[:, 1::2] = gate, up
        reference[f"{at}.gate_up_proj"] = np.ascontiguousarray(merged.transpose(0, 2, 1))
        reference[f"{at}.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
        reference[f"{at}.gate_up_proj_bias"] = bias
        reference[f"{at}.down_proj_bias"] = tensors[f"{at}.down_proj_bias"]
    finish_gguf(writer)
    return path, write_reference(path, model_dir, reference)


def write_gpt_oss_mxfp4_checkpoint(out_dir: Path, model_dir: Path) -> tuple[Path, Path]:
    """``model_dir`` (a float gpt-oss checkpoint) in the released checkpoints' format: each
    layer's ``gate_up_proj``/``down_proj`` as ``*_blocks [E, rows, K/32, 16]`` and
    ``*_scales [E, rows, K/32]`` (uint8; byte ``k`` of a block holds weights ``2k`` low and
    ``2k + 1`` high; gate/up rows interleaved) made with gguf-py's MXFP4 quantizer, and
    ``quantization_config: {quant_method: mxfp4}``.  Returns ``(out_dir, reference_dir)``:
    the reference is the float checkpoint with the experts as gguf-py dequantizes them."""
    import torch
    from gguf import GGMLQuantizationType, dequantize
    from gguf.quants import quantize
    from safetensors.torch import load_file, save_file

    mx = GGMLQuantizationType.MXFP4
    config = json.loads((model_dir / "config.json").read_text())
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    packed, reference = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors[name].float().transpose(1, 2).contiguous().numpy()  # [E, out, in]
        ggml = np.asarray(quantize(rows, mx)).reshape(*rows.shape[:2], -1, 17)
        nibbles = np.stack([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-2)  # [.., 2, 16]
        weights = nibbles.reshape(*ggml.shape[:3], 32)  # weights 0..31 in order
        blocks = weights[..., 0::2] | (weights[..., 1::2] << 4)
        del packed[name]
        packed[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        packed[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(ggml[..., 0]))
        values = np.asarray(dequantize(ggml.reshape(*rows.shape[:2], -1), mx), dtype=np.float32)
        reference[name] = torch.from_numpy(values.reshape(rows.shape)).transpose(1, 2).contiguous()
    ref_dir = out_dir.with_name(f"{out_dir.name}-reference")
    for target, weights_out, quantized in ((out_dir, packed, True), (ref_dir, reference, False)):
        copy_side_files(model_dir, target)
        if quantized:
            config_out = {**config, "quantization_config": {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
            }}  # fmt: skip
            (target / "config.json").write_text(json.dumps(config_out, indent=2))
        save_file({k: v.contiguous() for k, v in weights_out.items()},
                  str(target / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    return out_dir, ref_dir


def main(argv: list[str] | None = None) -> None:
    gguf_reference.main(write_gpt_oss_gguf, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    main()
