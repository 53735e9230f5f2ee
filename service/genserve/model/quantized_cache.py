"""The quantized matrices of a GGUF file, cached as safetensors beside its float conversion.

Reading a GGUF with ``gguf.GGUFReader`` parses every metadata field in Python (for the
embedded model, ~2-3 s spent on its 49k-token vocabulary), and a default CPU server reads the
file's blocks at every start (``--quantize gguf``).  The first start writes them, unchanged,
to ``<converted dir>/gguf-blocks-<content digest>.safetensors``, which later starts
memory-map in milliseconds.  The name carries the GGUF file's digest, so a cache never serves
another file's blocks; it is written to a temporary name and renamed, so a reader never sees
half a file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from genserve.model.quantization import QuantizedWeight

log = structlog.get_logger("genserve.model")


def cache_path(converted_dir: Path, gguf_digest: str) -> Path:
    return converted_dir / f"gguf-blocks-{gguf_digest[:16]}.safetensors"


def load_or_build(
    path: Path, build: Callable[[], dict[str, QuantizedWeight]]
) -> dict[str, QuantizedWeight]:
    """The matrices cached at ``path``, or ``build()``'s, cached there when writable."""
    if path.is_file():
        try:
            return _read(path)
        except Exception as exc:  # any damage (safetensors raises its own type): rebuild it
            log.warning("gguf_block_cache_unreadable", path=str(path), error=str(exc))
    tensors = build()
    # Nothing to keep (a file with no Q8_0/Q4 matrix): no file.  safetensors writes an empty
    # dict as a file its own reader refuses, and there is nothing to gain from one.
    if tensors:
        with contextlib.suppress(OSError):  # a read-only cache only costs the next start time
            _write(path, tensors)
    return tensors


def _write(path: Path, tensors: dict[str, QuantizedWeight]) -> None:
    flat: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name, q in tensors.items():
        flat[f"{name}.data"] = q.data
        flat[f"{name}.scales"] = q.scales
        if q.mins is not None:
            flat[f"{name}.mins"] = q.mins
        metadata[name] = f"{q.bits},{q.group}"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(flat, str(tmp), metadata=metadata)
    tmp.replace(path)


def _read(path: Path) -> dict[str, QuantizedWeight]:
    result: dict[str, QuantizedWeight] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        names = set(f.keys())
        for name, value in metadata.items():
            bits, group = (int(v) for v in value.split(","))
            mins = f.get_tensor(f"{name}.mins") if f"{name}.mins" in names else None
            result[name] = QuantizedWeight(
                f.get_tensor(f"{name}.data"), f.get_tensor(f"{name}.scales"), mins, bits, group
            )
    return result
