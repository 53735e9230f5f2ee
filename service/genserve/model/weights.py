"""Tensor-by-tensor access to a directory of safetensors files.

Layers pull exactly the tensors (or, for tensor-parallel shards, the row/column slices) they
own: :meth:`SafetensorsWeights.get_slice` reads only the requested range from the memory-mapped
file, so a shard never materialises a whole matrix it keeps a part of.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch
from safetensors import safe_open

from genserve.model.weight_files import weight_files


class MissingWeightError(KeyError):
    """The checkpoint lacks a tensor the architecture needs."""


class WeightSource(Protocol):
    """What layers load from: named tensors, whole or as a row/column range."""

    def has(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor: ...


class SafetensorsWeights:
    """Read-only view of every tensor of ``model_dir``'s weight files: the shards its
    ``model.safetensors.index.json`` names, or ``model*.safetensors``
    (:func:`~genserve.model.weight_files.weight_files`; other ``.safetensors`` files there,
    such as caches, are not model weights).

    Use as a context manager (or call :meth:`close`) to release the file handles.
    """

    def __init__(self, model_dir: Path) -> None:
        self._dir = model_dir
        index_file = model_dir / "model.safetensors.index.json"
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        if index_file.is_file():
            weight_map = json.loads(index_file.read_text())["weight_map"]
            self._where = {name: str(file) for name, file in weight_map.items()}
        else:
            for file in weight_files(model_dir):
                for name in self._open(file).keys():  # noqa: SIM118 - not a dict
                    self._where[name] = file
        if not self._where:
            raise MissingWeightError(f"no safetensors weights in {model_dir}")

    def _open(self, file: str) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            handle = safe_open(str(self._dir / file), framework="pt", device="cpu")
            self._handles[file] = handle
        return handle

    def names(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def _handle(self, name: str) -> Any:
        file = self._where.get(name)
        if file is None:
            raise MissingWeightError(f"weight {name!r} not found in {self._dir}")
        return self._open(file)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor, in its stored dtype, on CPU."""
        tensor: torch.Tensor = self._handle(name).get_tensor(name)
        return tensor

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, stop)`` of a tensor, reading only
        that range from disk."""
        view = self._handle(name).get_slice(name)
        index: list[slice] = [slice(None)] * len(view.get_shape())
        index[dim] = slice(start, stop)
        tensor: torch.Tensor = view[tuple(index)]
        return tensor

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
