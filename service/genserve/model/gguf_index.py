"""A GGUF file's tensors and scalar metadata, read without a Python object per array element.

``gguf.GGUFReader`` parses every element of every metadata array into numpy views of its
own: a 49,152-token vocabulary with its merges is ~200,000 of them, measured at +160 MB of
resident memory while a 98 MB model file loads (more than the file's whole matrix data
when it is small, and held until the reader goes).  Loading weights needs the tensor index
and a few scalars (architecture, head counts, alignment); config and tokenizer are read
once, elsewhere, into the model cache.  :class:`GGUFIndex` walks the header with
``struct``, skipping arrays by their element sizes (string arrays by their lengths), and
builds gguf-py's own :class:`~gguf.gguf_reader.ReaderTensor` records over one read-only
memory map, with the same ``data`` views (shapes and dtypes) gguf-py's reader gives.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian files; a
big-endian one is refused with a message).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types (gguf.GGUFValueType) -> struct code of a fixed-size scalar.
GGUF_SCALAR_CODES = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
GGUF_STRING, GGUF_ARRAY = 8, 9
# Tensor types whose ``data`` view is typed elements rather than bytes (as gguf-py's reader).
_ELEMENT_DTYPES = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass(frozen=True, slots=True)
class IndexField:
    """A scalar or string metadata value (arrays are skipped, not kept)."""

    value: int | float | bool | str

    def contents(self) -> int | float | bool | str:
        """The value, as ``gguf.ReaderField.contents()`` returns it for a scalar field."""
        return self.value


class GGUFIndex:
    """``path`` memory-mapped read-only: ``tensors`` (gguf-py ``ReaderTensor`` records, in file
    order), ``fields`` (scalar and string metadata by key), ``data`` (the whole map).

    Raises ValueError for a file that is not GGUF version 2 or 3, is big-endian, or whose
    header runs past its end."""

    def __init__(self, path: str | PathLike[str]) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quant_shape_to_byte_shape
        from gguf.gguf_reader import ReaderTensor

        self.data: np.memmap[Any, np.dtype[np.uint8]] = np.memmap(path, mode="r")
        self._view = memoryview(self.data)  # type: ignore[arg-type]
        self._path = str(path)
        if bytes(self._view[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
        (version,) = self._unpack("<I", 4)
        if version not in GGUF_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file)" if swapped in GGUF_VERSIONS else ""
            raise ValueError(f"{path}: GGUF version {version} is not supported{hint}")
        n_tensors, n_kv = self._unpack("<QQ", 8)
        offset = 24
        self.fields: dict[str, IndexField] = {}
        for _ in range(n_kv):
            key, offset = self._string(offset)
            (value_type,) = self._unpack("<I", offset)
            value, offset = self._value(value_type, offset + 4)
            if value is not None:
                self.fields[key] = IndexField(value)
        infos = []
        for _ in range(n_tensors):
            name, offset = self._string(offset)
            (n_dims,) = self._unpack("<I", offset)
            dims = np.array(self._unpack(f"<{n_dims}Q", offset + 4), dtype=np.uint64)
            offset += 4 + 8 * n_dims
            raw_type, data_offset = self._unpack("<IQ", offset)
            offset += 12
            infos.append((name, dims, raw_type, data_offset))
        alignment = self.fields.get("general.alignment", IndexField(_DEFAULT_ALIGNMENT)).value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        start = -(-offset // alignment) * alignment
        self.tensors: list[Any] = []
        for name, dims, raw_type, data_offset in infos:
            ggml_type = GGMLQuantizationType(raw_type)
            n_elements = int(np.prod(dims))
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elements * type_size // block_size
            begin = start + int(data_offset)
            shape: tuple[int, ...] = tuple(int(d) for d in reversed(dims.tolist()))
            dtype = _ELEMENT_DTYPES.get(ggml_type.name)
            if dtype is None:
                dtype, shape = np.uint8, tuple(quant_shape_to_byte_shape(shape, ggml_type))
            if begin + n_bytes > len(self.data):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            data = self.data[begin : begin + n_bytes].view(dtype).reshape(shape)
            self.tensors.append(
                ReaderTensor(name, ggml_type, dims, n_elements, n_bytes, begin, data, None)  # type: ignore[arg-type]
            )

    # ------------------------------------------------------------------ header parsing
    def _unpack(self, fmt: str, offset: int) -> tuple[Any, ...]:
        try:
            return struct.unpack_from(fmt, self._view, offset)
        except struct.error as exc:
            raise ValueError(f"{self._path}: GGUF header truncated at byte {offset}") from exc

    def _string(self, offset: int) -> tuple[str, int]:
        (length,) = self._unpack("<Q", offset)
        end = offset + 8 + length
        if end > len(self._view):
            raise ValueError(f"{self._path}: GGUF header truncated at byte {offset}")
        return bytes(self._view[offset + 8 : end]).decode("utf-8", errors="replace"), end

    def _value(self, value_type: int, offset: int) -> tuple[int | float | bool | str | None, int]:
        """A metadata value at ``offset`` and the offset after it; None for an array (its
        elements are skipped, not read)."""
        if value_type in GGUF_SCALAR_CODES:
            code = "<" + GGUF_SCALAR_CODES[value_type]
            (value,) = self._unpack(code, offset)
            return value, offset + struct.calcsize(code)
        if value_type == GGUF_STRING:
            return self._string(offset)
        if value_type == GGUF_ARRAY:
            item_type, count = self._unpack("<IQ", offset)
            return None, self._skip_items(item_type, count, offset + 12)
        raise ValueError(f"{self._path}: unknown GGUF metadata type {value_type}")

    def _skip_items(self, item_type: int, count: int, offset: int) -> int:
        if item_type in GGUF_SCALAR_CODES:
            return offset + count * struct.calcsize("<" + GGUF_SCALAR_CODES[item_type])
        skip: Callable[[int], int]
        if item_type == GGUF_STRING:
            lengths = struct.Struct("<Q")

            def skip(at: int) -> int:
                return at + 8 + int(lengths.unpack_from(self._view, at)[0])

        else:

            def skip(at: int) -> int:
                return self._value(item_type, at)[1]

        try:
            for _ in range(count):
                offset = skip(offset)
        except struct.error as exc:
            raise ValueError(f"{self._path}: GGUF header truncated in an array") from exc
        if offset > len(self._view):
            raise ValueError(f"{self._path}: GGUF header truncated in an array")
        return offset
