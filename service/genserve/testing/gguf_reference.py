"""A test GGUF converted from a Hugging Face checkpoint, written together with its
*reference*: the same checkpoint with every weight replaced by what gguf-py dequantizes
from the file, which is what a model served from the file must compute with.

The converters for particular architectures (:mod:`genserve.testing.moe_gguf`,
:mod:`genserve.testing.gpt_oss_gguf`) name and lay out the tensors; this module is the part
they share: reading the checkpoint, writing one tensor in a GGML type and returning the
values the file then holds, finishing the file, writing the reference directory beside it,
and the command line ``OUT.gguf MODEL_DIR [--experts TYPE] [--matrices TYPE]``.
"""

from __future__ import annotations

import argparse
import shutil
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from genserve.testing.tiny_gguf import random_blocks

# ``write(out, model_dir, expert_type, matrix_type) -> (out, reference_dir)``
Write = Callable[[Path, Path, str, str], tuple[Path, Path]]


def float_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``model_dir``'s ``*.safetensors`` files, as float32."""
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update({k: v.astype(np.float32) for k, v in load_file(str(file)).items()})
    return tensors


def _blocks(w: np.ndarray, qtype: Any, name: str) -> np.ndarray:
    """``w`` (float32, rows along the last axis) in ``qtype``'s blocks (uint8)."""
    from gguf.quants import quantize

    try:
        return np.asarray(quantize(w, qtype))
    except NotImplementedError:  # K-quants: random valid blocks of the same shape
        rows = int(np.prod(w.shape[:-1]))
        raw = random_blocks(qtype, rows, w.shape[-1], seed=zlib.crc32(name.encode()))
        return raw.reshape(*w.shape[:-1], -1)


def add_tensor(writer: Any, name: str, w: np.ndarray, type_name: str) -> np.ndarray:
    """Write ``w`` (float32, rows along the last axis) to ``writer`` (a ``GGUFWriter``) as
    tensor ``name`` in GGML type ``type_name``; returns its values as the file holds them
    (gguf-py's dequantization).  gguf-py's quantizer where it has one (F16, Q8_0, Q4_0,
    MXFP4...); K-quants, which gguf-py cannot quantize, get random valid blocks (seeded by
    the name).  Rows that are not whole blocks stay F32, as ``llama-quantize`` leaves them."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType[type_name]
    if w.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        qtype = GGMLQuantizationType.F32
    w = np.ascontiguousarray(w)
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, w)
        return w
    blocks = _blocks(w, qtype, name)
    writer.add_tensor(name, blocks, raw_dtype=qtype)
    return np.asarray(dequantize(blocks, qtype), dtype=np.float32).reshape(w.shape)


def finish_gguf(writer: Any) -> None:
    """Write ``writer``'s header, metadata and tensors to its file and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def copy_side_files(model_dir: Path, target: Path) -> None:
    """``model_dir``'s files other than weights (config, tokenizer, generation config) into
    ``target`` (made if missing)."""
    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, target / item.name)


def write_reference(path: Path, model_dir: Path, reference: Mapping[str, np.ndarray]) -> Path:
    """The reference checkpoint of the GGUF at ``path``: ``model_dir``'s side files and
    ``reference`` (Hugging Face names → the file's values) as one ``model.safetensors``, in
    ``{stem}-reference`` beside ``path``; returns that directory."""
    from safetensors.numpy import save_file

    ref_dir = path.with_name(f"{path.stem}-reference")
    copy_side_files(model_dir, ref_dir)
    save_file({k: np.ascontiguousarray(v) for k, v in reference.items()},
              str(ref_dir / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    return ref_dir


def main(write: Write, description: str, argv: list[str] | None = None) -> None:
    """``OUT.gguf MODEL_DIR [--experts TYPE] [--matrices TYPE]``: ``write`` them, print the
    file and its reference directory."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("out", type=Path)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--experts", default="F32")
    parser.add_argument("--matrices", default="F32")
    args = parser.parse_args(argv)
    print(*write(args.out, args.model_dir, args.experts, args.matrices))
