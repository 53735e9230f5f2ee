"""GGUF blocks read as QuantizedWeight keep the file's exact values, in Hugging Face row order.

Against the real default model (its Q4_1 layers and Q8_0 embedding), the reference is what
genserve's float path loads: transformers' dequantization saved by ``convert_gguf``.  Q8_0,
Q4_0 and Q4_1 are also checked on small files written here with gguf-py's own quantizers,
against gguf-py's dequantizer plus transformers' Q/K row permutation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from genserve.config import load_config
from genserve.model.gguf_weights import read_gguf_quantized, reverse_permutation
from genserve.model.loader import default_gguf_path, resolve_model

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 8, 64


@pytest.fixture(scope="module")
def default_converted() -> Path:
    """The embedded default model's cache entry (config and tokenizer; made once per
    machine where the server caches it, as ``genserve.testing.tiny_model`` does)."""
    return resolve_model(None, cache_dir=load_config([]).genserve_cache / "models").local_dir


@pytest.mark.slow
def test_default_model_blocks_dequantize_to_the_converted_weights(
    default_converted: Path, default_model_float32: PreTrainedModel
) -> None:
    config = json.loads((default_converted / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    quantized = read_gguf_quantized(default_gguf_path(), heads, kv_heads)
    # What transformers loads from the file (it dequantizes with gguf-py's dequantizer):
    # tests/conftest.py's session model, loaded from this file with gguf_file=.
    floats = default_model_float32.state_dict()

    layers = config["num_hidden_layers"]
    # 7 Q4_1 matrices per layer, the Q8_0 embedding; the output is tied (no output.weight).
    assert len(quantized) == 7 * layers + 1
    assert "lm_head.weight" not in quantized
    embed = quantized["model.embed_tokens.weight"]
    assert (embed.bits, embed.group, embed.mins) == (8, 32, None)
    assert embed.data.dtype == torch.int8
    q_proj = quantized["model.layers.0.self_attn.q_proj.weight"]
    assert (q_proj.bits, q_proj.group, q_proj.data.dtype) == (4, 32, torch.uint8)
    assert q_proj.scales.dtype == torch.float16
    assert q_proj.mins is not None and q_proj.mins.dtype == torch.float16
    # Bit-identical, not merely close: both sides compute scale * q (+ min) in float32 from
    # the same float16 scale/min and integer q (gguf-py's numpy dequantizer for transformers,
    # QuantizedWeight.dequantize here), products are exact and the one rounding (+ min) is
    # the same IEEE float32 add.  No ulp tolerance is needed.
    for name, qw in quantized.items():
        expected = floats[name]
        assert qw.dequantize(torch.float32).shape == expected.shape, name
        assert torch.equal(qw.dequantize(torch.float32), expected), name


def _write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, Any]]) -> None:
    writer = GGUFWriter(path, arch)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    for name, (array, qtype) in tensors.items():
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            writer.add_tensor(name, quantize(array, qtype))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _matrices(qtype: Any) -> dict[str, tuple[np.ndarray, Any]]:
    rng = np.random.default_rng(int(qtype))
    shapes = {
        "token_embd.weight": (50, HIDDEN),
        "output.weight": (50, HIDDEN),
        "blk.0.attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
        "blk.1.ffn_gate.weight": (96, HIDDEN),
        "blk.1.ffn_up.weight": (96, HIDDEN),
        "blk.1.ffn_down.weight": (HIDDEN, 96),
    }
    out: dict[str, tuple[np.ndarray, Any]] = {}
    for name, shape in shapes.items():
        array = rng.normal(0.0, 0.05, shape).astype(np.float32)
        array[0, :32] = 0.0  # an all-zero block (d == 0)
        array[1] += 0.3  # blocks away from zero: Q4_1's min is not -8 d there
        out[name] = (array, qtype)
    # Tensors that stay float are not returned.
    out["blk.0.attn_norm.weight"] = (np.ones(HIDDEN, np.float32), GGMLQuantizationType.F32)
    out["blk.0.ffn_norm.weight"] = (np.ones(HIDDEN, np.float32), GGMLQuantizationType.F32)
    return out


HF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
    "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
    "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
    "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
    "blk.1.ffn_gate.weight": "model.layers.1.mlp.gate_proj.weight",
    "blk.1.ffn_up.weight": "model.layers.1.mlp.up_proj.weight",
    "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "qtype",
    [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1],
    ids=lambda q: q.name,
)
def test_written_blocks_match_gguf_dequantize(tmp_path: Path, qtype: Any, arch: str) -> None:
    path = tmp_path / "model.gguf"
    _write_gguf(path, arch, _matrices(qtype))
    quantized = read_gguf_quantized(path, HEADS, KV_HEADS)
    assert set(quantized) == set(HF_NAMES.values())

    # transformers undoes llama.cpp's Q/K permutation for "llama" files only.
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    )
    for tensor in GGUFReader(path).tensors:
        if tensor.name not in HF_NAMES:
            continue
        expected = dequantize(tensor.data, tensor.tensor_type)
        if arch == "llama":
            expected = processor.process(expected, tensor.name).weights
        qw = quantized[HF_NAMES[tensor.name]]
        assert qw.bits == (8 if qtype == GGMLQuantizationType.Q8_0 else 4)
        assert qw.group == 32
        assert (qw.mins is None) == (qtype == GGMLQuantizationType.Q8_0)
        assert torch.equal(qw.dequantize(torch.float32), torch.from_numpy(expected)), tensor.name


def test_reverse_permutation_matches_transformers() -> None:
    rows = torch.arange(48 * 3, dtype=torch.float32).reshape(48, 3)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 6, "num_key_value_heads": 2})
    for name, heads in (("blk.0.attn_q.weight", 6), ("blk.0.attn_k.weight", 2)):
        expected = processor.process(rows.numpy(), name).weights
        assert torch.equal(rows[reverse_permutation(48, heads)], torch.from_numpy(expected))
    with pytest.raises(ValueError, match="heads"):
        reverse_permutation(48, 5)


def test_unmapped_architecture_is_refused(tmp_path: Path) -> None:
    """An architecture ``gguf_names`` has no layout for (GPT-2's names are not mapped)."""
    path = tmp_path / "gpt2.gguf"
    embedding = _matrices(GGMLQuantizationType.Q8_0)["token_embd.weight"]
    _write_gguf(path, "gpt2", {"token_embd.weight": embedding})
    with pytest.raises(ValueError, match="'gpt2' is not read natively"):
        read_gguf_quantized(path, HEADS, KV_HEADS)


def test_head_counts_must_match_the_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _write_gguf(path, "llama", _matrices(GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="head_count_kv is 2, not 4"):
        read_gguf_quantized(path, HEADS, 4)
