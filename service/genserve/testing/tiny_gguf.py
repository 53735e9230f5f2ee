"""Tiny random-weight Llama models as ``.gguf`` files, for tests of GGUF loading and serving.

The weights come from :func:`genserve.testing.tiny_model.make_tiny_model` (so the float
reference is an ordinary transformers model), are written the way llama.cpp's converter writes
them (``blk.N.*`` names, Q/K rows permuted for llama.cpp's rotary layout), quantized by
gguf-py's own quantizers where it has one, and the tokenizer is the embedded default model's,
copied from its GGUF metadata, so transformers can load the file (``gguf_file=``) as the
reference and prompts tokenize as for the real model.

    python -m genserve.testing.tiny_gguf OUT.gguf [--type F32|F16|Q8_0|Q4_0|Q4_1|Q4_K_M ...]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Matrix type per GGUF tensor kind for the presets this module writes; "*" is the default.
# The K-quant presets follow llama.cpp's mixes (Q4_K_M: Q6_K for attn_v / ffn_down, Q4_K
# elsewhere; the embedding Q8_0 here so that both K types and an 8-bit one are present).
PRESETS: dict[str, dict[str, str]] = {
    "F32": {"*": "F32"},
    "F16": {"*": "F16"},
    "Q8_0": {"*": "Q8_0"},
    "Q4_0": {"*": "Q4_0", "token_embd": "Q8_0"},
    "Q4_1": {"*": "Q4_1", "token_embd": "Q8_0"},
    "Q4_K_M": {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q8_0"},
    "Q5_K_M": {"*": "Q5_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
}
# K-quants work on super-blocks of 256 weights along a row: the model is made wide enough.
K_QUANT_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}

_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name of a Hugging Face Llama tensor."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{suffix}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for its rotary layout (what transformers reverses)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# One ``tokenizer.*`` metadata entry: key, value, value type, element type (arrays).
TokenizerField = tuple[str, Any, Any, Any]


def tokenizer_fields(source: Path) -> tuple[TokenizerField, ...]:
    """``source``'s ``tokenizer.*`` metadata as gguf-py reads it.  Parsed once per file
    version and process: gguf-py's reader walks the embedded model's 49,152 tokens and their
    merges element by element (~5 s), and a test session writes dozens of tiny GGUFs with
    that tokenizer.  The values are shared: callers copy before changing one."""
    stat = source.stat()
    return _tokenizer_fields(source.resolve(), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _tokenizer_fields(source: Path, mtime_ns: int, size: int) -> tuple[TokenizerField, ...]:
    from gguf import GGUFReader, GGUFValueType

    fields: list[TokenizerField] = []
    for key, field in GGUFReader(source).fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), vtype, sub))
    return tuple(fields)


def _copy_tokenizer(writer: Any, source: Path) -> None:
    for key, value, vtype, sub in tokenizer_fields(source):
        writer.add_key_value(key, value, vtype, sub_type=sub)


# Where a K-quant block keeps its float16 super-block scales, and a value for them that keeps
# random blocks' weights near the scale of a trained model's (|w| of order 0.1).
_K_SCALES: dict[str, tuple[tuple[int, float], ...]] = {
    "Q4_K": ((0, 2e-4), (2, 2e-4)),  # d, dmin
    "Q5_K": ((0, 1e-4), (2, 1e-4)),
    "Q6_K": ((208, 2e-5),),  # d after ql, qh and the int8 scales
}


def random_blocks(qtype: Any, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``[rows, cols]`` weights as random but valid blocks of ``qtype`` (uint8 ``[rows,
    bytes]``), for types gguf-py cannot quantize to: every bit pattern of the quants and
    sub-block scales is a valid block; only the float16 scales are set, to small values."""
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + rows * 7919 + cols)
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset, scale in _K_SCALES.get(qtype.name, ()):
        d = rng.uniform(0.5, 1.0, (rows, cols // block)).astype(np.float16) * np.float16(scale)
        raw[..., offset : offset + 2] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path,
    tensors: Mapping[str, np.ndarray],
    config: Mapping[str, Any],
    types: Mapping[str, str],
    tokenizer_gguf: Path,
) -> Path:
    """Write ``tensors`` (Hugging Face names, float32) of a Llama ``config`` as a GGUF file
    with each matrix in the type ``types`` names for its kind (see :data:`PRESETS`)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    _copy_tokenizer(writer, tokenizer_gguf)
    for hf, array in tensors.items():
        name = gguf_name(hf)
        w = np.ascontiguousarray(array, dtype=np.float32)
        if ".attn_q." in name:
            w = permute_rows(w, heads)
        elif ".attn_k." in name:
            w = permute_rows(w, kv_heads)
        kind = name.split(".")[-2]
        qtype = GGMLQuantizationType[types.get(kind, types["*"]) if w.ndim == 2 else "F32"]
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            try:
                blocks = quantize(w, qtype)
            except NotImplementedError:  # gguf-py 0.19 has no K-quant quantizer
                rows, cols = w.shape
                blocks = random_blocks(qtype, rows, cols, seed=zlib.crc32(name.encode()))
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def make_tiny_gguf(path: Path, preset: str = "F32", seed: int = 0, **overrides: Any) -> Path:
    """A tiny random Llama (``make_tiny_model``'s, tied embeddings) written to ``path`` in
    ``preset`` (a key of :data:`PRESETS`); K-quant presets get :data:`K_QUANT_SHAPE`."""
    import json

    from safetensors.numpy import load_file

    from genserve.model.loader import default_gguf_path
    from genserve.testing.tiny_model import make_tiny_model

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    shape = K_QUANT_SHAPE if "_K" in preset else {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp), "llama", seed, **{**shape, **overrides})
        config = json.loads((model_dir / "config.json").read_text())
        tensors: dict[str, np.ndarray] = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_gguf(path, tensors, config, PRESETS[preset], default_gguf_path())


def write_random_q8_0_gguf(path: Path, **config: Any) -> Path:
    """A Llama-shaped GGUF of random valid Q8_0 blocks (norms F32), written without
    quantizing anything: for measuring loading at sizes a random float model would take
    long to make.  ``config`` overrides a small 1B-like shape (4 layers, hidden 1024); the
    tokenizer is the embedded default model's."""
    from gguf import GGMLQuantizationType

    from genserve.model.loader import default_gguf_path

    cfg: dict[str, Any] = {
        "num_hidden_layers": 4,
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        **config,
    }
    rng = np.random.default_rng(0)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * hidden // cfg["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (hidden, hidden),
            f"{p}.self_attn.k_proj.weight": (kv, hidden),
            f"{p}.self_attn.v_proj.weight": (kv, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, hidden),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }

    writer_tensors: dict[str, tuple[np.ndarray, Any]] = {}
    for name, (n, k) in shapes.items():
        blocks = rng.integers(-127, 128, (n, k // 32, 34), dtype=np.int8).view(np.uint8)
        scales = rng.uniform(5e-4, 2e-3, (n, k // 32)).astype(np.float16)
        blocks[..., :2] = scales[..., None].view(np.uint8)
        writer_tensors[name] = (blocks.reshape(n, -1), GGMLQuantizationType.Q8_0)
    norms = [
        f"model.layers.{i}.{n}.weight"
        for i in range(cfg["num_hidden_layers"])
        for n in ("input_layernorm", "post_attention_layernorm")
    ] + ["model.norm.weight"]
    for name in norms:
        writer_tensors[name] = (np.ones(hidden, np.float32), GGMLQuantizationType.F32)
    return _write_raw(path, writer_tensors, cfg, default_gguf_path())


def _write_raw(
    path: Path, tensors: Mapping[str, tuple[np.ndarray, Any]], config: Mapping[str, Any], tok: Path
) -> Path:
    """Write already-encoded ``tensors`` (HF names; Q/K blocks taken as already in
    llama.cpp's row order) with ``config``'s Llama metadata."""
    from gguf import GGMLQuantizationType, GGUFWriter

    heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // heads
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    _copy_tokenizer(writer, tok)
    for hf, (array, qtype) in tensors.items():
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf), array)
        else:
            writer.add_tensor(gguf_name(hf), array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", choices=sorted(PRESETS), default="F32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(make_tiny_gguf(args.out, args.type, args.seed))


if __name__ == "__main__":
    main()
