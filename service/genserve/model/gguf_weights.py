"""The quantized matrices of a GGUF file, kept as they are stored (``--quantize gguf``).

The normal GGUF path (``conversion``) lets transformers dequantize the whole file to float32
safetensors, which is what the float layers load.  ``--quantize gguf`` instead serves the
file's own 4- and 8-bit blocks: re-quantizing the dequantized floats would compute new scales
and lose the exact values the file's author shipped, and would cost a pass over every weight.
The three block formats llama.cpp uses for whole-model quantization of small models map onto
``QuantizedWeight`` without touching a nibble:

* ``Q8_0`` (34 bytes per 32 weights: fp16 ``d``, 32 int8): 8 bits, ``scales = d``;
* ``Q4_1`` (20 bytes: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles): ``scales = d``,
  ``mins = m``, and the nibble bytes concatenated in block order are ``QuantizedWeight``'s
  4-bit layout already;
* ``Q4_0`` (18 bytes: fp16 ``d``, 16 bytes): ``w = d (q - 8)``, so ``mins = -8 d``, exact in
  float16 (a power-of-two multiple).

Everything else (norms in F32, F16/BF16 matrices, K-quants) is left out of the result; the
caller keeps those from the float conversion.  The blocks are split with numpy views over the
reader's memory map, one vectorised copy per field, no loop over blocks.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of ``llama`` models for its
rotary layout, and transformers undoes that when it reads a GGUF
(``LlamaTensorProcessor._reverse_permute_weights``).  Rows are independent in every format,
so the same undoing is a row gather here (:meth:`QuantizedWeight.rows`), with the index built
by applying transformers' reshape/swap to ``arange(N)``: the result then lines up, row for row,
with the float weights of the converted model.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genserve.model.quantization import QuantizedWeight

# GGUF architecture -> whether llama.cpp permuted attn_q/attn_k rows (transformers reverses
# it only for "llama": TENSOR_PROCESSORS in modeling_gguf_pytorch_utils).  Mistral models are
# written with architecture "llama"; Qwen2 keeps Hugging Face's row order.
LLAMA_LIKE_ARCHITECTURES = {"llama": True, "qwen2": False}

_BLOCK = 32
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF matrix, or None for tensors not served
    quantized (norms, biases, anything this module does not map)."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def reverse_permutation(rows: int, n_head: int) -> torch.Tensor:
    """Row index undoing llama.cpp's Q/K permutation: ``W_hf = W_gguf[index]``.

    The same reshape/swap transformers applies to the weights, applied to ``arange(rows)``."""
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _fp16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The float16 at byte ``offset`` of every block: ``[N, blocks]`` float16, copied."""
    raw = np.ascontiguousarray(blocks[..., offset : offset + 2])
    return torch.from_numpy(raw.view(np.float16)[..., 0].copy())


def _quantized(blocks: np.ndarray, qtype: Any) -> QuantizedWeight:
    """``blocks`` ``[N, K / 32, block bytes]`` uint8 as a QuantizedWeight (exact)."""
    from gguf import GGMLQuantizationType as Q

    n = blocks.shape[0]
    if qtype == Q.Q8_0:
        qs = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1)
        return QuantizedWeight(torch.from_numpy(qs), _fp16(blocks, 0), None, 8, _BLOCK)
    if qtype == Q.Q4_1:
        qs = np.ascontiguousarray(blocks[..., 4:]).reshape(n, -1)
        return QuantizedWeight(torch.from_numpy(qs), _fp16(blocks, 0), _fp16(blocks, 2), 4, _BLOCK)
    if qtype == Q.Q4_0:
        qs = np.ascontiguousarray(blocks[..., 2:]).reshape(n, -1)
        d = _fp16(blocks, 0)
        mins = d * -8  # exact in float16 unless |d| > 8188 overflows
        if not torch.isfinite(mins).all():
            raise ValueError("a Q4_0 scale is too large for its min (-8 d) in float16")
        return QuantizedWeight(torch.from_numpy(qs), d, mins, 4, _BLOCK)
    raise AssertionError(f"unhandled GGML type {qtype}")


def read_gguf_quantized(
    gguf_file: Path, num_heads: int, num_kv_heads: int
) -> dict[str, QuantizedWeight]:
    """Every Q8_0 / Q4_0 / Q4_1 matrix of ``gguf_file`` by Hugging Face parameter name
    (``model.embed_tokens.weight``, ``lm_head.weight`` when the file has ``output.weight``,
    the attention and MLP projections of each layer), with Q/K rows in Hugging Face order.

    ``num_heads`` / ``num_kv_heads`` are the model's attention heads (config.json), which the
    Q/K row order depends on.  Raises ValueError for a file that is not a llama-like model or
    whose head counts disagree with the given ones.
    """
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader

    block_bytes = {Q.Q8_0: 2 + _BLOCK, Q.Q4_1: 4 + _BLOCK // 2, Q.Q4_0: 2 + _BLOCK // 2}
    reader = GGUFReader(gguf_file)
    arch = _field(reader, "general.architecture")
    if arch not in LLAMA_LIKE_ARCHITECTURES:
        raise ValueError(
            f"{gguf_file}: GGUF architecture {arch!r} is not llama-like; quantized GGUF "
            f"weights are read for {sorted(LLAMA_LIKE_ARCHITECTURES)}"
        )
    for key, given in (("head_count", num_heads), ("head_count_kv", num_kv_heads)):
        stored = _field(reader, f"{arch}.attention.{key}")
        if isinstance(stored, int) and stored != given:
            raise ValueError(f"{gguf_file}: {arch}.attention.{key} is {stored}, not {given}")
    permuted = LLAMA_LIKE_ARCHITECTURES[arch]

    out: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        size = block_bytes.get(tensor.tensor_type)
        if name is None or size is None or len(tensor.shape) != 2:
            continue
        k, n = (int(x) for x in tensor.shape)  # GGUF lists dimensions innermost first
        data = np.asarray(tensor.data)
        if k % _BLOCK or data.shape != (n, k // _BLOCK * size):
            raise ValueError(
                f"{gguf_file}: {tensor.name} ({tensor.tensor_type.name}, {k}x{n}) has data "
                f"of shape {data.shape}"
            )
        qw = _quantized(data.reshape(n, k // _BLOCK, size), tensor.tensor_type)
        if permuted and ".attn_q." in tensor.name:
            qw = qw.rows(reverse_permutation(n, num_heads))
        elif permuted and ".attn_k." in tensor.name:
            qw = qw.rows(reverse_permutation(n, num_kv_heads))
        out[name] = qw
    return out
