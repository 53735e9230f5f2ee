"""What a start derives from a model directory through transformers' config classes — the
native spec (``ModelConfig``) and the tokenizer class ``AutoTokenizer`` picks — remembered
under the model cache, so that later starts of the same files skip those classes.

Why: a transformers config class is cheap, but importing one is not.  Llama's module (and
others') imports ``utils.type_validators`` → ``activations`` → ``integrations.hub_kernels``
→ ``core_model_loading``, i.e. transformers' model-loading machinery: ``torch.distributed
.tensor`` (with sympy) and accelerate, ~1.1 s of every start on a 2-vCPU Zen 4 guest, for
code that a natively served model never runs.  ``AutoTokenizer`` loads the same class to
choose the tokenizer's.  The spec and the class are pure functions of the directory's files,
transformers' version and genserve's family code, so they are computed the first time (as
before, through ``AutoConfig`` / ``AutoTokenizer``) and read back after.

The key (:func:`memo_key`) covers everything the two depend on: a scheme tag, transformers'
version, the source of genserve's spec derivation (``model/spec.py``, ``model/families``),
``trust_remote_code``, the directory's resolved path (``AutoTokenizer`` matches it against
name patterns) and every file in it but hidden ones and a cache entry's record (name, size,
mtime; ``config.json`` and ``tokenizer_config.json`` by content too).  Any change gives a
new key: a miss, the transformers route again, and a new memo.  Directories with remote
code (``auto_map``) are never memoised.  A memo that cannot be read or written is a miss,
never a failed start.

The spec is stored as a pickle: the cache is genserve's own (it also holds the compiled kernel
libraries the server loads), and a frozen dataclass tree round-trips exactly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import pickle
from pathlib import Path
from typing import Any

from genserve.model.spec import ModelConfig

# Bumped when what a memo holds or how its key is made changes.
_SCHEME = "derived-v1"
# genserve's own record in a model-cache entry: touched at every use, read by no transformers
# code (model/model_cache.py); hidden files (the record's temporary copies) are skipped too.
_IGNORED = frozenset({"entry.json"})
_READ_BY_CONTENT = ("config.json", "tokenizer_config.json")
# Every changed file, transformers upgrade or genserve version makes new memos (two files of
# ~1 KB each) and nothing reads the old ones again: past this many files a write drops the
# least recently used down to half of it (a read touches its memo), so the directory stays
# small whatever the history.
MAX_MEMO_FILES = 512


@functools.cache
def _code_digest() -> str:
    """sha256 of the source the spec is derived by (the families and the spec types)."""
    from genserve.model import families, spec

    digest = hashlib.sha256()
    for path in [Path(spec.__file__), *sorted(Path(families.__file__).parent.glob("*.py"))]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def memo_key(model_dir: Path, trust_remote_code: bool) -> str | None:
    """The key of what ``model_dir`` derives to, or None where it is not memoised (remote code,
    an unreadable directory)."""
    import transformers

    digest = hashlib.sha256(
        f"{_SCHEME}|{transformers.__version__}|{_code_digest()}|{trust_remote_code}".encode()
    )
    try:
        directory = model_dir.resolve()
        digest.update(str(directory).encode())
        for path in sorted(directory.iterdir()):
            if path.name in _IGNORED or path.name.startswith(".") or not path.is_file():
                continue
            stat = path.stat()
            digest.update(f"|{path.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
        for name in _READ_BY_CONTENT:
            path = directory / name
            if path.is_file():
                text = path.read_bytes()
                if b'"auto_map"' in text and "auto_map" in json.loads(text):
                    return None
                digest.update(text)
    except (OSError, ValueError):
        return None
    return digest.hexdigest()[:32]


class DerivedMemo:
    """The memo of one model directory in ``memo_dir`` (None: memoise nothing)."""

    def __init__(self, memo_dir: Path | None, model_dir: Path, trust_remote_code: bool) -> None:
        self._dir = memo_dir
        self._key = None if memo_dir is None else memo_key(model_dir, trust_remote_code)

    def _path(self, kind: str) -> Path | None:
        if self._dir is None or self._key is None:
            return None
        return self._dir / f"{self._key}.{kind}"

    def _read(self, kind: str) -> bytes | None:
        path = self._path(kind)
        if path is None:
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: kept by _prune
        return data

    def _write(self, kind: str, data: bytes) -> None:
        path = self._path(kind)
        if path is None:
            return
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # readers see the whole memo or none
            _prune(path.parent)

    def spec(self) -> ModelConfig | None:
        """The native spec remembered for the directory, or None."""
        data = self._read("spec.pickle")
        if data is None:
            return None
        try:
            value = pickle.loads(data)
        except Exception:  # a memo cut short or of another layout: a miss
            return None
        return value if isinstance(value, ModelConfig) else None

    def remember_spec(self, config: ModelConfig) -> None:
        self._write("spec.pickle", pickle.dumps(config))

    def tokenizer_class(self) -> type | None:
        """The transformers tokenizer class ``AutoTokenizer`` picked for the directory, or
        None."""
        data = self._read("tokenizer.json")
        if data is None:
            return None
        try:
            record = json.loads(data)
            module = importlib.import_module(str(record["module"]))
            cls = getattr(module, str(record["name"]))
        except Exception:  # unreadable, or a class this transformers no longer has
            return None
        return cls if isinstance(cls, type) else None

    def remember_tokenizer_class(self, cls: type) -> None:
        """Remembers ``cls`` when it is transformers' own (never a remote-code class)."""
        if not cls.__module__.startswith("transformers."):
            return
        record: dict[str, Any] = {"module": cls.__module__, "name": cls.__qualname__}
        self._write("tokenizer.json", json.dumps(record).encode())


def _prune(memo_dir: Path) -> None:
    """Drop the least recently used memos once there are more than MAX_MEMO_FILES."""
    entries = []
    for entry in os.scandir(memo_dir):
        with contextlib.suppress(OSError):
            entries.append((entry.stat().st_mtime, entry.path))
    if len(entries) <= MAX_MEMO_FILES:
        return
    entries.sort()
    for _, path in entries[: len(entries) - MAX_MEMO_FILES // 2]:
        with contextlib.suppress(OSError):
            os.unlink(path)
