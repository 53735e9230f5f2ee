"""A GGUF metadata reader shaped like ``gguf.GGUFReader`` where transformers' config reader
(``load_gguf_checkpoint(..., return_tensors=False)``) looks, but built with ``struct`` and
plain Python objects instead of one numpy memmap view per array element.

Why: transformers reads a GGUF's config through ``gguf.GGUFReader``, which makes two numpy
views per string of every metadata array (each ``__array_finalize__``-ed: microseconds
apiece).  A Llama-3 vocabulary is 128,256 strings plus ~280,000 merges; one such parse was 77 s
of an 8B-shape file's first start on a busy 2-core host, and a start parsed the file three
times (the config, the config again under the tokenizer, genserve's own hparams).  This
reader gives the same values (a test compares the configs both readers produce) in a
fraction of the time.

What it provides, and nothing more: ``fields`` (key → :class:`MetadataField` with gguf-py's
``name``/``parts``/``data``/``types`` layout: ``parts`` are the key length, key bytes and
type, then the value's parts; ``data`` indexes the value parts) and ``tensors`` (records
with ``name``).  A file it cannot read (nested arrays, a big-endian file) is handed to
gguf-py's own reader by :func:`open_reader`.

:func:`fast_config_reader` installs it as ``gguf.GGUFReader`` for the duration of a
``with`` block: transformers imports the name inside the function each call, so the swap
is seen there and undone after.
"""

from __future__ import annotations

import contextlib
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np

from genserve.model.gguf_index import (
    GGUF_ARRAY,
    GGUF_MAGIC,
    GGUF_SCALAR_CODES,
    GGUF_STRING,
    GGUF_VERSIONS,
)

_LEN = struct.Struct("<Q")


class UnsupportedGGUF(ValueError):
    """A layout this reader leaves to gguf-py (nested arrays, big-endian, unknown types)."""


@dataclass(slots=True)
class MetadataField:
    """One metadata key/value, laid out as ``gguf.ReaderField``: ``parts[data[i]]`` is the
    i-th value (a 1-tuple for a number, the UTF-8 bytes for a string)."""

    name: str
    parts: list[Any]
    data: list[int]
    types: list[int] = field(default_factory=list)

    def contents(self) -> Any:
        """The value as Python (a list for an array), as ``ReaderField.contents()``."""
        item = self.types[-1]
        values = [_decode(self.parts[i], item) for i in self.data]
        return values if self.types[0] == GGUF_ARRAY else values[0]


@dataclass(frozen=True, slots=True)
class TensorName:
    """A tensor of the file, by name only (config reading needs no more)."""

    name: str


def _decode(part: Any, value_type: int) -> Any:
    return part.decode("utf-8") if value_type == GGUF_STRING else part[0]


class GGUFMetadataReader:
    """``path``'s metadata and tensor names; see the module docstring.

    Raises :class:`UnsupportedGGUF` where gguf-py's reader should be used instead, and
    ValueError for a file that is not GGUF or is cut short."""

    def __init__(self, path: str | PathLike[str], mode: str = "r") -> None:
        del mode  # gguf.GGUFReader's signature; this reader only reads
        self._path = str(path)
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != GGUF_MAGIC:
                raise ValueError(f"{path}: not a GGUF file (no GGUF magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in GGUF_VERSIONS:
                raise UnsupportedGGUF(f"{path}: GGUF version {version}")
        # The header is at most a few tens of MB (a vocabulary): map the file once and read
        # the header through a memoryview, never the tensor data.
        self._buf = memoryview(np.memmap(path, mode="r"))  # type: ignore[arg-type]
        offset = 24
        # gguf-py lists the header's own numbers as fields too (UINT32, UINT64, UINT64).
        self.fields: dict[str, MetadataField] = {
            "GGUF.version": MetadataField("GGUF.version", [(version,)], [0], [4]),
            "GGUF.tensor_count": MetadataField("GGUF.tensor_count", [(n_tensors,)], [0], [10]),
            "GGUF.kv_count": MetadataField("GGUF.kv_count", [(n_kv,)], [0], [10]),
        }
        for _ in range(n_kv):
            key_len = self._unpack(_LEN, offset)
            key = bytes(self._buf[offset + 8 : offset + 8 + key_len])
            offset += 8 + key_len
            (value_type,) = self._unpack_fmt("<I", offset)
            offset += 4
            head_parts: list[Any] = [
                np.array([key_len], dtype=np.uint64),
                np.frombuffer(key, dtype=np.uint8),
                np.array([value_type], dtype=np.uint32),
            ]
            name = key.decode("utf-8")
            self.fields[name] = self._field(name, head_parts, value_type, offset)
            offset = self._end
        self.tensors: list[TensorName] = []
        for _ in range(n_tensors):
            name_len = self._unpack(_LEN, offset)
            name = bytes(self._buf[offset + 8 : offset + 8 + name_len]).decode("utf-8")
            offset += 8 + name_len
            (n_dims,) = self._unpack_fmt("<I", offset)
            offset += 4 + 8 * n_dims + 12  # dims, type, data offset
            self.tensors.append(TensorName(name))
        if offset > len(self._buf):
            raise ValueError(f"{self._path}: GGUF header truncated")

    # ------------------------------------------------------------------ parsing
    def _unpack(self, fmt: struct.Struct, offset: int) -> int:
        try:
            return int(fmt.unpack_from(self._buf, offset)[0])
        except struct.error as exc:
            raise ValueError(f"{self._path}: GGUF header truncated at byte {offset}") from exc

    def _unpack_fmt(self, fmt: str, offset: int) -> tuple[Any, ...]:
        try:
            return struct.unpack_from(fmt, self._buf, offset)
        except struct.error as exc:
            raise ValueError(f"{self._path}: GGUF header truncated at byte {offset}") from exc

    def _field(self, name: str, parts: list[Any], value_type: int, offset: int) -> MetadataField:
        """The field at ``offset`` (its value's type ``value_type``); sets ``self._end``."""
        if value_type in GGUF_SCALAR_CODES:
            code = "<" + GGUF_SCALAR_CODES[value_type]
            parts.append(self._unpack_fmt(code, offset))
            self._end = offset + struct.calcsize(code)
            return MetadataField(name, parts, [3], [value_type])
        if value_type == GGUF_STRING:
            length = self._unpack(_LEN, offset)
            parts += [
                np.array([length], dtype=np.uint64),
                bytes(self._buf[offset + 8 : offset + 8 + length]),
            ]
            self._end = offset + 8 + length
            return MetadataField(name, parts, [4], [value_type])
        if value_type != GGUF_ARRAY:
            raise UnsupportedGGUF(f"{self._path}: metadata type {value_type} of {name}")
        item_type, count = self._unpack_fmt("<IQ", offset)
        offset += 12
        parts += [np.array([item_type], dtype=np.uint32), np.array([count], dtype=np.uint64)]
        first = len(parts)
        if item_type in GGUF_SCALAR_CODES:
            code = GGUF_SCALAR_CODES[item_type]
            size = struct.calcsize("<" + code) * count
            if offset + size > len(self._buf):
                raise ValueError(f"{self._path}: GGUF header truncated in {name}")
            values = struct.unpack_from(f"<{count}{code}", self._buf, offset)
            parts += [(v,) for v in values]
            offset += size
        elif item_type == GGUF_STRING:
            buf, unpack = self._buf, _LEN.unpack_from
            try:
                for _ in range(count):
                    (length,) = unpack(buf, offset)
                    parts.append(bytes(buf[offset + 8 : offset + 8 + length]))
                    offset += 8 + length
            except struct.error as exc:
                raise ValueError(f"{self._path}: GGUF header truncated in {name}") from exc
        else:
            raise UnsupportedGGUF(f"{self._path}: array of type {item_type} in {name}")
        self._end = offset
        return MetadataField(
            name, parts, list(range(first, first + count)), [GGUF_ARRAY, item_type]
        )


def open_reader(path: str | PathLike[str], mode: str = "r") -> Any:
    """A :class:`GGUFMetadataReader` of ``path``, or gguf-py's reader where this one does not
    read the file's layout."""
    try:
        return GGUFMetadataReader(path, mode)
    except UnsupportedGGUF:
        from gguf.gguf_reader import GGUFReader

        return GGUFReader(Path(path), mode)  # type: ignore[arg-type]


_SWAP_LOCK = threading.Lock()


@contextlib.contextmanager
def fast_config_reader(hidden: frozenset[str] = frozenset()) -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` is :func:`open_reader` (transformers' GGUF config
    reader imports the name from ``gguf`` at each call), without the metadata keys
    ``hidden`` (ones transformers misreads: ``gguf_config.HIDDEN_FROM_TRANSFORMERS``).  One
    swap at a time: the lock keeps two loading threads from restoring each other's swap."""
    import gguf

    def reader(path: str | PathLike[str], mode: str = "r") -> Any:
        opened = open_reader(path, mode)
        for key in hidden:
            opened.fields.pop(key, None)
        return opened

    with _SWAP_LOCK:
        original = gguf.GGUFReader
        gguf.GGUFReader = reader  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]
