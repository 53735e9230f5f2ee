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

K-quants (``Q4_K``, ``Q5_K``, ``Q6_K``: super-blocks of 256) are copied from the mapping as they
are, bytes untouched, into a :class:`~genserve.model.kquants.KQuantWeight`, whose kernel decodes
them as it multiplies.  Everything else (norms in F32, F16/BF16 matrices, other types) is left
out of the result and served in floats.  The blocks are split with numpy views over the
reader's memory map, one vectorised copy per field, no loop over blocks.

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of ``llama`` models for its
rotary layout, and transformers undoes that when it reads a GGUF
(``LlamaTensorProcessor._reverse_permute_weights``).  Rows are independent in every format,
so the same undoing is a row gather here (:meth:`QuantizedWeight.rows`), with the index built
by applying transformers' reshape/swap to ``arange(N)``: the result then lines up, row for row,
with the float weights of the converted model.
"""

from __future__ import annotations

import contextlib
import mmap
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from genserve.model import gguf_names
from genserve.model.kquants import K_TYPES, AnyQuantized, KQuantWeight
from genserve.model.quantization import QuantizedWeight

_BLOCK = 32


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face parameter name of a GGUF matrix, or None for tensors not served
    quantized (norms, biases, anything not mapped): ``gguf_names.hf_matrix_name``."""
    return gguf_names.hf_matrix_name(gguf_name, arch)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of any tensor genserve loads from a GGUF of ``arch`` (matrices,
    norms, biases); None for tensors it does not use: ``gguf_names.hf_tensor_name``."""
    return gguf_names.hf_tensor_name(gguf_name, arch)


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


_BLOCK_BYTES = {"Q8_0": 2 + _BLOCK, "Q4_1": 4 + _BLOCK // 2, "Q4_0": 2 + _BLOCK // 2}
# Routed-expert types ``genserve::moe_experts_gguf`` runs: (weights, bytes) per block.
EXPERT_TYPES = {
    "Q8_0": (_BLOCK, 2 + _BLOCK),
    "Q4_0": (_BLOCK, 2 + _BLOCK // 2),
    "MXFP4": (_BLOCK, 1 + _BLOCK // 2),  # gpt-oss: an E8M0 exponent, 16 bytes of e2m1
    **{name: (256, size) for name, (_, size) in K_TYPES.items()},
}
# Rows of a matrix copied out of the file mapping at a time (see _copy_in_chunks).
_CHUNK_BYTES = 4 << 20


def _empty_like_rows(part: QuantizedWeight, rows: int) -> QuantizedWeight:
    """A QuantizedWeight of ``rows`` rows with ``part``'s layout, to be filled chunk by chunk."""

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype)

    mins = None if part.mins is None else rows_of(part.mins)
    return QuantizedWeight(rows_of(part.data), rows_of(part.scales), mins, part.bits, part.group)


def _float16_to_float32(half: np.ndarray) -> np.ndarray:
    """``half`` widened to float32: the values gguf-py's dequantizer gives (the conversion is
    exact), through torch's vectorised, threaded cast instead of numpy's scalar one (~6x
    faster here: 3.6 s of a 1B F16 file's start went to numpy's ``astype``, issue #28)."""
    with warnings.catch_warnings():
        # The file is mapped read-only; torch warns that the tensor over it is not writable,
        # and it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(half)
    # Into numpy's memory, as astype's result was (allocated the same way: the same peak).
    out = np.empty(half.shape, dtype=np.float32)
    torch.from_numpy(out).copy_(source)
    return out


class GGUFWeights:
    """A GGUF file as a :class:`~genserve.model.weights.WeightSource`, read in place.

    The file is memory-mapped (``gguf.GGUFReader``); nothing is converted ahead of loading.
    :meth:`quantized` hands out a matrix stored as Q8_0 / Q4_0 / Q4_1 as a
    :class:`QuantizedWeight` (its blocks split by one vectorised copy per field), and one
    stored as Q4_K / Q5_K / Q6_K as a :class:`KQuantWeight` (its bytes, copied as they are);
    :meth:`get` / :meth:`get_slice` dequantize one tensor to float32 with gguf-py's own
    dequantizer — exactly the values transformers loads from the file — for what is served
    in floats (norms, F32/F16 matrices, types without a kernel, ``--quantize none``).  Names,
    Q/K rows and Gemma's shifted norms are Hugging Face's (``gguf_names``: what llama.cpp's
    converter did per architecture, undone as transformers undoes it).
    After a tensor is read its pages of the mapping are released, so the file does not stay
    resident beside the copy made of it.

    Raises ValueError for a file of an architecture ``gguf_names`` does not map, or whose
    head counts disagree with ``num_heads`` / ``num_kv_heads`` (the model's, from its config).
    """

    def __init__(self, gguf_file: Path, num_heads: int, num_kv_heads: int) -> None:
        from genserve.model.gguf_index import GGUFIndex

        self._file = gguf_file
        # Not gguf.GGUFReader: its per-element parse of the tokenizer's arrays alone cost
        # ~160 MB of resident memory while loading (model/gguf_index.py).
        self._reader = GGUFIndex(gguf_file)
        arch = _field(self._reader, "general.architecture")
        layout = gguf_names.layout(arch)
        if layout is None:
            raise ValueError(
                f"{gguf_file}: GGUF architecture {arch!r} is not read natively; GGUF weights "
                f"are read for {sorted(gguf_names.LAYOUTS)}"
            )
        self._arch: str = arch
        for key, given in (("head_count", num_heads), ("head_count_kv", num_kv_heads)):
            stored = _field(self._reader, f"{arch}.attention.{key}")
            if isinstance(stored, int) and stored != given:
                raise ValueError(f"{gguf_file}: {arch}.attention.{key} is {stored}, not {given}")
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self._permuted = layout.permuted_qk
        self._tensors: dict[str, Any] = {}
        for tensor in self._reader.tensors:
            name = hf_tensor_name(tensor.name, arch)
            if name is not None:
                self._tensors[name] = tensor

    # ------------------------------------------------------------------ WeightSource
    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def _tensor(self, name: str) -> Any:
        from genserve.model.weights import MissingWeightError

        tensor = self._tensors.get(name)
        if tensor is None:
            raise MissingWeightError(f"weight {name!r} not found in {self._file}")
        return tensor

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(x) for x in reversed(self._tensor(name).shape))  # innermost last

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor as float32 (dequantized), on CPU."""
        from gguf import GGMLQuantizationType as Q
        from gguf import dequantize

        tensor = self._tensor(name)
        if tensor.tensor_type == Q.F32:
            values = np.array(tensor.data, dtype=np.float32)
        elif tensor.tensor_type == Q.F16:
            values = _float16_to_float32(np.asarray(tensor.data).view(np.float16))
        else:
            values = dequantize(tensor.data, tensor.tensor_type)
        out = torch.from_numpy(np.ascontiguousarray(values).reshape(self.shape(name)))
        shift = gguf_names.norm_shift(tensor.name, self._arch)
        if shift:  # Gemma: llama.cpp stored w + 1 (exact to undo: 1 + w is in [0.5, 2))
            out = out - shift
        self._release(tensor)
        index = self._row_order(tensor)
        return out if index is None else out[index].contiguous()

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Rows (``dim=0``) or columns (``dim=1``) ``[start, stop)`` of :meth:`get`."""
        whole = self.get(name)
        return whole.narrow(dim, start, stop - start).contiguous()

    def close(self) -> None:
        self._tensors.clear()

    def __enter__(self) -> GGUFWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ quantized
    def quantized(self, name: str) -> AnyQuantized | None:
        """Matrix ``name`` in its stored format, when genserve keeps that format (Q8_0,
        Q4_0, Q4_1; Q4_K, Q5_K, Q6_K); None for other types (served as floats through
        :meth:`get`)."""
        tensor = self._tensors.get(name)
        if tensor is None or len(tensor.shape) != 2 or hf_name(tensor.name, self._arch) is None:
            return None
        qtype = tensor.tensor_type.name
        block, size = (256, K_TYPES[qtype][1]) if qtype in K_TYPES else (_BLOCK, 0)
        size = size or _BLOCK_BYTES.get(qtype, 0)
        if not size:
            return None
        k, n = (int(x) for x in tensor.shape)  # GGUF lists dimensions innermost first
        data = np.asarray(tensor.data)
        if k % block or data.shape != (n, k // block * size):
            raise ValueError(
                f"{self._file}: {tensor.name} ({qtype}, {k}x{n}) has data of shape {data.shape}"
            )
        qw = self._copy_in_chunks(tensor, data, qtype, n, k)
        index = self._row_order(tensor)
        return qw if index is None else qw.rows(index)

    def _copy_in_chunks(
        self, tensor: Any, data: np.ndarray, qtype: str, n: int, k: int
    ) -> AnyQuantized:
        """``data`` (``[N, row bytes]``, the file mapping) in genserve's layout, copied a
        few MiB of rows at a time with each chunk's file pages released after it: the load
        peak holds the copy plus one chunk of the file, not the copy plus the whole matrix."""
        row_bytes = int(data.shape[1])
        step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
        if qtype in K_TYPES:  # the bytes as stored
            out = np.empty((n, row_bytes), dtype=np.uint8)
            for r0 in range(0, n, step):
                out[r0 : r0 + step] = data[r0 : r0 + step]
                self._release_rows(tensor, r0, min(r0 + step, n), row_bytes)
            return KQuantWeight.from_owned(out, qtype)
        size = _BLOCK_BYTES[qtype]
        whole: QuantizedWeight | None = None
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            part = _quantized(data[r0:r1].reshape(-1, k // _BLOCK, size), tensor.tensor_type)
            if whole is None:
                whole = _empty_like_rows(part, n)
            whole.data[r0:r1] = part.data
            whole.scales[r0:r1] = part.scales
            if whole.mins is not None and part.mins is not None:
                whole.mins[r0:r1] = part.mins
            self._release_rows(tensor, r0, r1, row_bytes)
        assert whole is not None  # n > 0: a GGUF matrix has rows
        return whole

    def expert_blocks(self, name: str) -> tuple[torch.Tensor, str] | None:
        """Stacked routed experts ``name`` (``model.layers.{i}.mlp.experts.{gate,up,down}_proj``,
        ``ffn_*_exps`` in the file) as their blocks, bytes as stored: (uint8 ``[E, rows, row
        bytes]``, GGML type name), for the types the quantized expert op runs
        (:data:`EXPERT_TYPES`); None for any other type (served in floats through
        :meth:`get`) or a name that is not an expert stack.  Copied a few MiB at a time with
        the file's pages released after each chunk, so loading never holds a float copy."""
        tensor = self._tensors.get(name)
        if tensor is None or not gguf_names.is_expert_stack(tensor.name, self._arch):
            return None
        qtype = tensor.tensor_type.name
        if qtype not in EXPERT_TYPES or len(tensor.shape) != 3:
            return None
        block, size = EXPERT_TYPES[qtype]
        k, n, e = (int(x) for x in tensor.shape)  # innermost first
        data = np.asarray(tensor.data)
        if k % block or data.shape != (e, n, k // block * size):
            raise ValueError(
                f"{self._file}: {tensor.name} ({qtype}, {k}x{n}x{e}) has data of shape {data.shape}"
            )
        rows = data.reshape(e * n, -1)
        row_bytes = int(rows.shape[1])
        out = np.empty((e * n, row_bytes), dtype=np.uint8)
        step = max(1, _CHUNK_BYTES // max(row_bytes, 1))
        for r0 in range(0, e * n, step):
            out[r0 : r0 + step] = rows[r0 : r0 + step]
            self._release_rows(tensor, r0, min(r0 + step, e * n), row_bytes)
        return torch.from_numpy(out).view(e, n, row_bytes), qtype

    def quantized_view(self) -> Mapping[str, AnyQuantized]:
        """:meth:`quantized` as a read-only mapping that reads a matrix when it is looked
        up, so a caller going module by module holds one module's matrices at a time."""
        return _QuantizedView(self)

    def quantized_names(self) -> list[str]:
        """Names :meth:`quantized` returns a matrix for."""
        return [
            name
            for name, t in self._tensors.items()
            if (t.tensor_type.name in _BLOCK_BYTES or t.tensor_type.name in K_TYPES)
            and hf_name(t.name, self._arch) is not None
        ]

    def _row_order(self, tensor: Any) -> torch.Tensor | None:
        kind = tensor.name.split(".")[-2]
        if not self._permuted or kind not in self._heads:
            return None
        return reverse_permutation(int(tensor.shape[-1]), self._heads[kind])

    def _release_rows(self, tensor: Any, r0: int, r1: int, row_bytes: int) -> None:
        """Drop the file pages of rows ``[r0, r1)`` of ``tensor`` (they were copied)."""
        mapping = getattr(self._reader.data, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        begin = int(tensor.data_offset) + r0 * row_bytes
        start = begin // page * page
        # Whole pages only: the page shared with the next chunk is released with it.
        end = (int(tensor.data_offset) + r1 * row_bytes) // page * page
        if r1 * row_bytes >= int(tensor.n_bytes):
            end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > start:
            with contextlib.suppress(OSError, ValueError):
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _release(self, tensor: Any) -> None:
        """Drop ``tensor``'s pages of the file mapping from this process's resident set
        (they were copied); best effort, the mapping stays valid."""
        mapping = getattr(self._reader.data, "_mmap", None)
        if mapping is None or not hasattr(mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        start = int(tensor.data_offset) // page * page
        length = int(tensor.data_offset) + int(tensor.n_bytes) - start
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(mmap.MADV_DONTNEED, start, length)


class _QuantizedView(Mapping[str, AnyQuantized]):
    def __init__(self, weights: GGUFWeights) -> None:
        self._weights = weights
        self._names = weights.quantized_names()

    def __getitem__(self, name: str) -> AnyQuantized:
        qw = self._weights.quantized(name) if name in self._names else None
        if qw is None:
            raise KeyError(name)
        return qw

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def read_gguf_quantized(
    gguf_file: Path, num_heads: int, num_kv_heads: int
) -> dict[str, AnyQuantized]:
    """Every Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K matrix of ``gguf_file`` by Hugging Face
    parameter name (``model.embed_tokens.weight``, ``lm_head.weight`` when the file has
    ``output.weight``, the attention and MLP projections of each layer), with Q/K rows in
    Hugging Face order.
    See :class:`GGUFWeights` (which loading uses, one matrix at a time)."""
    weights = GGUFWeights(gguf_file, num_heads, num_kv_heads)
    out: dict[str, AnyQuantized] = {}
    for name in weights.quantized_names():
        qw = weights.quantized(name)
        assert qw is not None
        out[name] = qw
    return out
