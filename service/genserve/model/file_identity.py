"""A GGUF file's identity without reading the whole file: the key of its model-cache entry
and the ``model_sha`` a server reports.

A full sha256 read every byte of a multi-gigabyte file once more at a model's first start
(a few seconds from the page cache, far longer from disk or on a busy host), just before
the weights are read from it again.  :func:`sampled_digest` reads instead:

* the whole header (metadata and tensor table): everything the cache entry is built from
  (config and tokenizer come from the metadata, ``tie_word_embeddings`` from the tensor
  names), so two files with the same digest always have the same entry;
* every tensor that is not a matrix, in full (norms, Phi-3's rope factors, which the config
  reads): a few MB;
* the file's size and :data:`SAMPLES` evenly spaced windows of :data:`WINDOW` bytes of the
  tensor data, plus its last window: ~4 MB.

The trade-off: two files that differ only in weight bytes that no window covers (a
fine-tune differing in a few blocks) get the same digest, hence the same cache entry (no
harm: the entry depends only on what is hashed in full) and the same ``model_sha`` (the
cost: ``model_sha`` tells files apart with high probability, not with sha256's certainty;
it is reported as ``sha256-sampled:``).  The digest is memoised under the cache per (path,
inode, size, mtime): later starts read nothing but the stat.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from genserve.model import model_cache

SAMPLES = 64
WINDOW = 64 << 10
# Bumped when what the digest covers changes (memo entries of another scheme are ignored).
_SCHEME = "gguf-sampled-v1"


def sampled_digest(path: Path) -> str:
    """sha256 over ``path``'s header, non-matrix tensors, size and sampled windows (hex)."""
    from genserve.model.gguf_index import GGUFIndex

    index = GGUFIndex(path)
    size = path.stat().st_size
    starts = [int(t.data_offset) for t in index.tensors]
    data_start = min(starts) if starts else size
    digest = hashlib.sha256(f"{_SCHEME}|{size}".encode())
    view = memoryview(index.data)  # type: ignore[arg-type]
    digest.update(view[:data_start])
    for tensor in index.tensors:
        if len(tensor.shape) < 2:
            begin = int(tensor.data_offset)
            digest.update(view[begin : begin + int(tensor.n_bytes)])
    span = size - data_start
    if span > 0:
        for i in range(SAMPLES):
            at = data_start + span * i // SAMPLES
            digest.update(view[at : at + WINDOW])
        digest.update(view[max(data_start, size - WINDOW) : size])
    return digest.hexdigest()


def file_digest(path: Path, cache_dir: Path) -> str:
    """:func:`sampled_digest` of ``path``, memoised under ``cache_dir`` per (path, inode,
    size, mtime) so that later starts do not read the file at all."""
    stat = path.stat()
    identity = f"{_SCHEME}|{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:32]
    memo = model_cache.digest_memo_dir(cache_dir) / f"{key}.txt"
    with contextlib.suppress(OSError):
        value = memo.read_text().strip()
        if len(value) == 64:  # a memo cut short is recomputed
            return value
    value = sampled_digest(path)
    with contextlib.suppress(OSError):
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(value)
        tmp.replace(memo)
    return value
