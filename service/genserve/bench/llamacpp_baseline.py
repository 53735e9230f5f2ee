"""llama.cpp as a baseline, in this process, through ``llama-cpp-python``'s low-level API
(the optional ``llamacpp`` bench extra: it builds llama.cpp from source, ~6+ minutes on 2
cores, and is never needed by the server or its tests).

* :func:`make_gguf` writes the embedded model as F32 / Q8_0 / … with llama.cpp's own
  quantizer (``llama_model_quantize``, which dequantizes the source's blocks first), so that
  genserve (which dequantizes the same Q4_1 file to float32 when loading it) and llama.cpp
  run the same weights.
* :meth:`LlamaCppModel.greedy` runs ``streams`` sequences at once the way ``llama-server -np N`` and
  ``llama-batched-bench`` do: one ``llama_decode`` per step over a batch holding one token of
  every sequence (each with its own ``seq_id``), greedy argmax of each row's logits.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp's ``enum llama_ftype`` values of the formats the comparison uses.
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:  # the optional extra
        raise RuntimeError(
            "the llama.cpp baseline needs llama-cpp-python: pip install 'genserve[llamacpp]' "
            "(builds llama.cpp from source)"
        ) from exc
    return llama_cpp


def make_gguf(source: Path, out_dir: Path, ftype: str, threads: int) -> Path:
    """``source`` re-encoded as ``ftype`` (cached in ``out_dir`` by name)."""
    lib = _llama_cpp()
    target = out_dir / f"{source.stem}.{ftype}.gguf"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    params = lib.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    params.allow_requantize = True  # the source is already quantized (Q4_1)
    partial = target.with_suffix(".partial")
    status = lib.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {ftype}) failed: {status}")
    partial.rename(target)
    return target


@dataclass(frozen=True, slots=True)
class LlamaCppRun:
    decode_tok_s: float  # generated tokens per second over the decode steps
    ms_per_step: float
    tokens: list[list[int]]  # each stream's generated ids (first one from the prefill)


class LlamaCppModel:
    """One loaded GGUF with a context for up to ``max_streams`` sequences."""

    def __init__(
        self,
        path: Path,
        max_streams: int,
        max_tokens_per_seq: int,
        threads: int,
        extra_bufts: bool = True,
    ):
        """``extra_bufts``: llama.cpp's repacked weight layouts (AMX tiles, interleaved
        Q4_0/Q8_0 for AVX); off, it runs its plain CPU kernels."""
        lib = _llama_cpp()
        self._lib = lib
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        if hasattr(mparams, "use_extra_bufts"):
            mparams.use_extra_bufts = extra_bufts
        self._model = lib.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = max_streams * max_tokens_per_seq
        cparams.n_batch = max(512, cparams.n_ctx)
        cparams.n_ubatch = cparams.n_batch
        cparams.n_seq_max = max_streams
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self._batch = lib.llama_batch_init(cparams.n_batch, 0, max_streams)

    def close(self) -> None:
        lib = self._lib
        lib.llama_batch_free(self._batch)
        lib.llama_free(self._ctx)
        lib.llama_model_free(self._model)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """``entries``: (token, position, sequence, wants logits)."""
        batch = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        status = self._lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed: {status}")

    def _argmax(self, index: int) -> int:
        ptr = self._lib.llama_get_logits_ith(self._ctx, index)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> LlamaCppRun:
        """Prefill every prompt in one batch, then ``new_tokens - 1`` batched decode steps."""
        lib = self._lib
        lib.llama_memory_clear(lib.llama_get_memory(self._ctx), True)
        entries = [
            (tok, pos, seq, pos == len(p) - 1)
            for seq, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        self._decode(entries)
        last_rows = np.cumsum([len(p) for p in prompts]) - 1
        out = [[self._argmax(int(row))] for row in last_rows]
        start = time.perf_counter()
        for step in range(1, new_tokens):
            self._decode([(out[s][-1], len(p) + step - 1, s, True) for s, p in enumerate(prompts)])
            for s in range(len(prompts)):
                out[s].append(self._argmax(s))
        elapsed = time.perf_counter() - start
        steps = new_tokens - 1
        return LlamaCppRun(len(prompts) * steps / elapsed, elapsed / steps * 1000, out)
