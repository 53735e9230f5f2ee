"""Real-shape Llama GGUF files in llama.cpp's Q4_K_M mix, written straight from random K-quant
blocks: no float model, no quantizer, so an 8B-shape file (4.9 GB) is made in a minute and a
few hundred MB of memory (one tensor at a time), for measuring start-up and memory at the
sizes people download (issue #28: "an 8B GGUF cannot load in 24 GB").

Which type each matrix gets is llama.cpp's ``llama_tensor_get_type`` for ``LLAMA_FTYPE_
MOSTLY_Q4_K_M``: Q4_K everywhere, Q6_K for the output matrix and for ``attn_v`` and
``ffn_down`` of the layers ``use_more_bits`` picks (the first and last eighth, and every
third layer between), norms F32.  The blocks are random but valid
(:func:`genserve.testing.tiny_gguf.random_blocks`: any bit pattern of quants and sub-block
scales, small float16 super-block scales).  The tokenizer is the embedded default model's
(SmolLM2's 49,152 tokens, copied from its GGUF metadata); a larger ``vocab_size`` (Llama-3's
128,256, the default for the 8B shape) appends reserved control tokens, as Llama-3's own
``<|reserved_special_token_N|>`` are, so the embedding and output matrices have the real
shape and llama.cpp accepts the file.  Llama-3.1's rope scaling (``rope_freqs``) is left out:
it changes no shape and no load cost.

    python -m genserve.testing.kquant_gguf OUT.gguf --shape llama-3.1-8b-shape
"""

from __future__ import annotations

import argparse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from genserve.testing.shape_model import SHAPES

# Llama-3's vocabulary, the 8B shape's default (the tokenizer is padded up to it).
LLAMA3_VOCAB = 128256
# A shape small enough for a CI test of the same path (K-quant rows need multiples of 256).
SHAPES_EXTRA: dict[str, dict[str, Any]] = {
    "small-kquant-shape": {
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "tie_word_embeddings": False,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
    },
}
_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL (gguf.TokenType.CONTROL)


def shape_config(shape: str) -> dict[str, Any]:
    """The config fields of ``shape`` (a key of ``shape_model.SHAPES`` or :data:`SHAPES_EXTRA`)."""
    table = {**SHAPES, **SHAPES_EXTRA}
    if shape not in table:
        raise ValueError(f"unknown shape {shape!r}; choose from {', '.join(sorted(table))}")
    return dict(table[shape])


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(kind: str, layer: int, num_layers: int) -> str:
    """The GGML type llama.cpp's Q4_K_M gives a matrix of ``kind`` (``attn_q``, ``output``,
    ...) in layer ``layer`` (ignored for ``token_embd`` / ``output``)."""
    if kind == "output":
        return "Q6_K"
    if kind in ("attn_v", "ffn_down") and use_more_bits(layer, num_layers):
        return "Q6_K"
    return "Q4_K"


def _matrices(cfg: dict[str, Any], vocab: int) -> Iterator[tuple[str, str, int, int]]:
    """(GGUF name, type, rows, columns) of every matrix, in llama.cpp's file order."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    yield "token_embd.weight", "Q4_K", vocab, hidden
    for i in range(layers):
        for kind, rows, cols in (
            ("attn_q", q_out, hidden),
            ("attn_k", kv_out, hidden),
            ("attn_v", kv_out, hidden),
            ("attn_output", hidden, q_out),
            ("ffn_gate", inter, hidden),
            ("ffn_up", inter, hidden),
            ("ffn_down", hidden, inter),
        ):
            yield f"blk.{i}.{kind}.weight", q4_k_m_type(kind, i, layers), rows, cols
    if not cfg.get("tie_word_embeddings", False):
        yield "output.weight", "Q6_K", vocab, hidden


def _norms(cfg: dict[str, Any]) -> list[str]:
    layers = range(cfg["num_hidden_layers"])
    names = [f"blk.{i}.{n}.weight" for i in layers for n in ("attn_norm", "ffn_norm")]
    return [*names, "output_norm.weight"]


def _add_tokenizer(writer: Any, source: Path, vocab: int) -> int:
    """Copy ``source``'s tokenizer metadata, padded with control tokens up to ``vocab``
    entries; returns the vocabulary size written."""
    from genserve.testing.tiny_gguf import tokenizer_fields

    num_tokens = 0
    for key, value, vtype, sub in tokenizer_fields(source):
        if key == "tokenizer.ggml.tokens":
            num_tokens = len(value)
            value = [
                *value,
                *(f"<|reserved_special_token_{i}|>" for i in range(vocab - len(value))),
            ]
        elif key == "tokenizer.ggml.token_type":
            value = [*value, *([_TOKEN_TYPE_CONTROL] * (vocab - len(value)))]
        elif key == "tokenizer.ggml.scores":
            value = [*value, *([0.0] * (vocab - len(value)))]
        writer.add_key_value(key, value, vtype, sub_type=sub)
    return max(vocab, num_tokens)


def write_q4_k_m_gguf(
    path: Path, shape: str = "llama-3.1-8b-shape", vocab_size: int | None = None, seed: int = 0
) -> Path:
    """Write a random ``shape`` model in llama.cpp's Q4_K_M mix to ``path`` (see the module
    docstring).  ``vocab_size``: None gives Llama-3's 128,256 for an 8B/1B shape and the
    tokenizer's own 49,152 for the small one; it is never below the tokenizer's."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    from genserve.model.loader import default_gguf_path
    from genserve.testing.tiny_gguf import random_blocks

    cfg = shape_config(shape)
    if vocab_size is None:
        vocab_size = 0 if shape in SHAPES_EXTRA else LLAMA3_VOCAB
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, "llama")
    writer.add_name(f"random {shape} Q4_K_M")
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(1e-5)
    vocab = _add_tokenizer(writer, default_gguf_path(), vocab_size)
    writer.add_vocab_size(vocab)
    # Tensor infos first, then the data one tensor at a time (never the whole model in memory).
    matrices = list(_matrices(cfg, vocab))
    for name, qtype, rows, cols in matrices:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        nbytes = rows * cols // block * size
        raw = GGMLQuantizationType[qtype]
        writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), nbytes, raw)
    hidden = cfg["hidden_size"]
    for name in _norms(cfg):
        writer.add_tensor_info(name, (hidden,), np.dtype(np.float32), 4 * hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, qtype, rows, cols in matrices:
        tensor_seed = seed + zlib.crc32(name.encode())
        writer.write_tensor_data(
            random_blocks(GGMLQuantizationType[qtype], rows, cols, tensor_seed)
        )
    rng = np.random.default_rng(seed)
    for _ in _norms(cfg):  # non-trivial norm weights near one
        writer.write_tensor_data(rng.uniform(0.8, 1.2, hidden).astype(np.float32))
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", default="llama-3.1-8b-shape")
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_q4_k_m_gguf(args.out, args.shape, args.vocab, args.seed))


if __name__ == "__main__":
    main()
