"""One-time conversion of checkpoints the native loader cannot read (GGUF, PyTorch ``.bin``)
into a cached safetensors directory.

Transformers does the reading (and for GGUF the dequantization); the result is saved with
``save_pretrained`` as float32 safetensors plus the tokenizer, as an entry of genserve's model
cache keyed by the source's content (``model_cache``: one entry per GGUF digest, built once
even by concurrent starts, interrupted builds cleaned up).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

import structlog
from tqdm import tqdm

from genserve.model import model_cache

log = structlog.get_logger("genserve.model")

_CHUNK = 1 << 22


def file_digest(path: Path, cache_dir: Path) -> str:
    """sha256 of ``path``'s content, memoised per (path, size, mtime) under ``cache_dir`` so
    that later starts do not re-read a multi-gigabyte file."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    memo = model_cache.digest_memo_dir(cache_dir) / f"{key.hexdigest()[:32]}.txt"
    with contextlib.suppress(OSError):
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(value)
        tmp.replace(memo)
    return value


def dir_fingerprint(model_dir: Path) -> str:
    """Cheap identity of a directory of ``.bin`` weights: names, sizes and mtimes."""
    entries = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file()
    )
    return hashlib.sha256(json.dumps([str(model_dir.resolve()), entries]).encode()).hexdigest()


def convert_gguf(gguf_file: Path, cache_dir: Path, trust_remote_code: bool = False) -> Path:
    """The cache entry of ``gguf_file``'s content (built once, whatever the file is called)."""
    entry = model_cache.gguf_entry(cache_dir, file_digest(gguf_file, cache_dir))
    return model_cache.build_once(
        entry,
        lambda out: _save_converted(
            gguf_file.parent, out, trust_remote_code, gguf_file=gguf_file.name
        ),
        source=str(gguf_file.resolve()),
    )


def convert_pytorch_bin(model_dir: Path, cache_dir: Path, trust_remote_code: bool = False) -> Path:
    """Re-save a ``pytorch_model*.bin`` checkpoint directory as safetensors (once)."""
    entry = model_cache.bin_entry(cache_dir, dir_fingerprint(model_dir))
    return model_cache.build_once(
        entry,
        lambda out: _save_converted(model_dir, out, trust_remote_code, gguf_file=None),
        source=str(model_dir.resolve()),
    )


def _save_converted(
    src_dir: Path, out_dir: Path, trust_remote_code: bool, gguf_file: str | None
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file is not None else {}
    with tqdm(total=3, desc=f"Converting {gguf_file or src_dir.name}", unit="stage") as bar:
        bar.set_postfix_str("reading weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(src_dir), dtype=torch.float32, trust_remote_code=trust_remote_code, **extra
        )
        bar.update()
        bar.set_postfix_str("reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            str(src_dir), trust_remote_code=trust_remote_code, **extra
        )
        bar.update()
        bar.set_postfix_str("writing safetensors")
        # A GGUF-loaded model carries a quantizer that refuses serialization although its
        # weights are already plain dequantized tensors; dropping it makes them saveable.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
        bar.update()
