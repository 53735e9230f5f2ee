"""genserve's model cache (``<genserve cache>/models``): what it keeps, building an entry once,
cleaning up after interrupted work, listing and pruning.

Layout::

    models/
      gguf-<sha256[:16]>/   one entry per GGUF *content* (whatever the file is called):
                            config.json, tokenizer files, entry.json
      bin-<fingerprint>/    a pytorch_model*.bin directory re-saved as safetensors
      .tmp/<entry>.<rand>/  an entry being built (renamed into place when complete)
      .locks/<entry>.lock   held (flock) while an entry is built; removed afterwards
      .digests/             memoised file digests (path, size, mtime -> sha256)
      .derived/             what a model directory derives to through transformers'
                            config classes (model/derived_memo.py)

An entry directory under its final name is always complete: it is built in ``.tmp`` and
appears with one atomic rename.  An entry that must be replaced (another format version,
damaged) stays in place, readable, while its successor is built beside it; the two are then
swapped in one step (:func:`_install`), so a process still reading the old one (an older
genserve sharing the cache) never finds the name missing or half deleted.

``entry.json`` records the sources it was built from, when, and each file's size and
sha256: an entry whose files no longer match (cut short, deleted, overwritten) is rebuilt
at the next start, never served.  Its mtime is touched at every use
(``genserve cache prune --older-than``).

Interrupted work (a process killed while building) leaves a temporary directory and a lock
file; :func:`clean_interrupted` removes both at the next start, but only when no live
process holds the lock: a lock is an ``flock`` on an open file, which the kernel releases
when its process dies.  A lock file is only unlinked by a holder of its lock, and
:func:`_lock` re-checks after locking that the path still names the file it locked, so
removing one never lets two builders in at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("genserve.model")

ENTRY_FILE = "entry.json"
_TMP, _LOCKS, _DIGESTS, _DERIVED = ".tmp", ".locks", ".digests", ".derived"
# Entry files up to this size are recorded with their sha256 (configs, tokenizers: a few MB,
# milliseconds to check at a start); larger ones (converted weights) by size.
_HASHED_UP_TO = 64 << 20


class EntryBusy(RuntimeError):
    """Another process holds the entry's lock (it is being built)."""


def gguf_entry(cache: Path, digest: str) -> Path:
    """The entry of the GGUF file whose content has sha256 ``digest``."""
    return cache / f"gguf-{digest[:16]}"


def bin_entry(cache: Path, fingerprint: str) -> Path:
    """The entry of a ``pytorch_model*.bin`` directory with ``fingerprint``."""
    return cache / f"bin-{fingerprint[:16]}"


def is_complete(entry: Path) -> bool:
    return (entry / "config.json").is_file()


def is_current(entry: Path, version: int) -> bool:
    """``entry`` is complete, intact (:func:`entry_intact`) and was written by the converter
    of format ``version`` (entries from before formats were recorded count as version 1)."""
    if not is_complete(entry):
        return False
    record = read_record(entry)
    return record.get("version", 1) == version and entry_intact(entry, record)


def _file_manifest(directory: Path) -> dict[str, list[object]]:
    """``{name: [size, sha256 or None]}`` of ``directory``'s files (the entry record aside);
    files over :data:`_HASHED_UP_TO` (converted weights) by size only."""
    manifest: dict[str, list[object]] = {}
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or path.name.startswith(f".{ENTRY_FILE}") or path.name == ENTRY_FILE:
            continue
        size = path.stat().st_size
        digest = _sha256(path) if size <= _HASHED_UP_TO else None
        manifest[str(path.relative_to(directory))] = [size, digest]
    return manifest


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry_intact(entry: Path, record: dict[str, object] | None = None) -> bool:
    """Every file ``entry``'s record lists is there with its recorded size and digest (a
    config or tokenizer cut short by a full disk, a file deleted or overwritten by hand):
    such an entry is rebuilt, never served.  Entries recorded before manifests (no
    ``files``) are taken as they are."""
    record = read_record(entry) if record is None else record
    files = record.get("files")
    if files is None:
        return True
    if not isinstance(files, dict):
        return False
    for name, expected in files.items():
        path = entry / name
        try:
            size, digest = expected
            if path.stat().st_size != size or (digest is not None and _sha256(path) != digest):
                return False
        except (OSError, TypeError, ValueError):
            return False
    return True


def build_once(entry: Path, build: Callable[[Path], None], source: str, version: int = 1) -> Path:
    """``entry``, built by ``build(tmp_dir)`` unless it exists in format ``version``;
    concurrent callers wait for one build.  An entry of another format (written by an older
    converter: the key is the source's content, not the code that converted it) is replaced,
    so an upgrade never serves a stale config.  Marks the entry used and records ``source``
    in its ``entry.json``."""
    cache = entry.parent
    if not is_current(entry, version):
        cache.mkdir(parents=True, exist_ok=True)
        clean_interrupted(cache)
        with _lock(cache, entry.name, blocking=True):
            if not is_current(entry, version):  # nobody finished it while we waited
                if entry.exists():
                    intact = entry_intact(entry)
                    log.info(
                        "model_cache_entry_stale" if intact else "model_cache_entry_damaged",
                        entry=str(entry),
                        version=version,
                    )
                # The old entry (if any) stays readable until the new one replaces it.
                _build(entry, build, source, version)
    _record_use(entry, source)
    return entry


def _discard(entry: Path) -> None:
    """Move ``entry`` out of its final name, then delete it (``genserve cache rm/prune`` only:
    a start replaces an entry with :func:`_install` instead): a concurrent start never sees
    it half deleted (it finds no entry and builds one)."""
    trash_root = entry.parent / _TMP
    trash_root.mkdir(exist_ok=True)
    trash = trash_root / f"{entry.name}.removed-{os.getpid()}"
    os.rename(entry, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _build(entry: Path, build: Callable[[Path], None], source: str, version: int) -> None:
    tmp_root = entry.parent / _TMP
    tmp_root.mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{entry.name}.", dir=tmp_root))
    try:
        log.info("model_conversion_started", source=source, target=str(entry))
        build(tmp)
        record = {"sources": [source], "created": time.time(), "version": version}
        _write_record(tmp, {**record, "files": _file_manifest(tmp)})
        # mkdtemp creates the directory private; the cache is as shared as its parent.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        _install(tmp, entry)
        log.info("model_conversion_done", target=str(entry))
    finally:
        # After a swap this is the replaced entry: a reader that still has its files open
        # keeps reading them (unlinked files live while open); readers by path see the new.
        shutil.rmtree(tmp, ignore_errors=True)


def _install(new: Path, entry: Path) -> None:
    """Put the complete directory ``new`` under ``entry``'s name in one step.

    No entry there: one rename.  An entry there (stale or damaged; the caller holds the
    build lock): the two directories are exchanged atomically (``renameat2``
    ``RENAME_EXCHANGE``), so at every instant ``entry`` names a complete directory and the
    old one ends at ``new``'s path for the caller to delete.  Where the filesystem cannot
    exchange, the old entry is renamed aside and the new one renamed in: a window of two
    renames (microseconds), never the length of a build."""
    try:
        os.rename(new, entry)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.EISDIR, errno.ENOTDIR):
            raise
    if _exchange(new, entry):
        return
    aside = Path(tempfile.mkdtemp(prefix=f"{entry.name}.replaced-", dir=new.parent))
    os.rename(entry, aside / "old")
    try:
        os.rename(new, entry)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False
    where the C library or the filesystem has no such call (then nothing moved)."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    path, fd = ctypes.c_char_p, ctypes.c_int
    renameat2.argtypes = [fd, path, fd, path, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _write_record(entry: Path, record: dict[str, object]) -> None:
    tmp = entry / f".{ENTRY_FILE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(entry / ENTRY_FILE)


def read_record(entry: Path) -> dict[str, object]:
    try:
        record = json.loads((entry / ENTRY_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def record_sources(record: dict[str, object]) -> tuple[str, ...]:
    """The source paths an entry's record lists (none for a damaged record)."""
    sources = record.get("sources")
    return tuple(str(s) for s in sources) if isinstance(sources, list) else ()


def _record_use(entry: Path, source: str) -> None:
    """Touch the entry (last use) and add ``source`` to the names it was reached by; a
    read-only cache only loses the bookkeeping."""
    with contextlib.suppress(OSError):
        record = read_record(entry)
        sources = list(record_sources(record))
        if source not in sources:
            record["sources"] = [*sources, source]
            _write_record(entry, record)
        os.utime(entry / ENTRY_FILE)


@contextlib.contextmanager
def _lock(cache: Path, name: str, blocking: bool) -> Iterator[None]:
    """Hold the build lock of entry ``name``; the lock file is removed on release.

    Raises :class:`EntryBusy` when ``blocking`` is false and another process holds it."""
    path = cache / _LOCKS / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        handle = path.open("a")
        try:
            flags = fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB)
            try:
                fcntl.flock(handle, flags)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    raise EntryBusy(name) from exc
                raise
            try:
                same = os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # unlinked by the holder we waited for: lock the new file
                continue
            try:
                yield
            finally:
                with contextlib.suppress(OSError):
                    path.unlink()
            return
        finally:
            handle.close()


def clean_interrupted(cache: Path) -> list[Path]:
    """Remove what killed builds left in ``cache`` (temporary directories, lock files) that
    no live process is working on; return the paths removed."""
    removed: list[Path] = []
    names: set[str] = set()
    tmp_root, lock_root = cache / _TMP, cache / _LOCKS
    if tmp_root.is_dir():
        names |= {p.name.rsplit(".", 1)[0] for p in tmp_root.iterdir()}
    if lock_root.is_dir():
        names |= {p.name.removesuffix(".lock") for p in lock_root.glob("*.lock")}
    for name in sorted(names):
        lock_file = lock_root / f"{name}.lock"
        existed = lock_file.exists()
        try:
            with _lock(cache, name, blocking=False):
                for tmp in tmp_root.glob(f"{name}.*") if tmp_root.is_dir() else []:
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp)
        except EntryBusy:
            continue  # a live build
        if existed:
            removed.append(lock_file)
    removed += _clean_legacy(cache)
    if removed:
        log.info("model_cache_cleaned", removed=[str(p) for p in removed])
    return removed


def _clean_legacy(cache: Path) -> list[Path]:
    """Leftovers of genserve versions that kept temporaries and locks beside the entries
    (``.<entry>.<rand>/`` and ``.<entry>.lock``), removed when their lock is free."""
    removed: list[Path] = []
    if not cache.is_dir():
        return removed
    for lock_file in cache.glob(".*.lock"):
        with lock_file.open("a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue
            name = lock_file.name[1:].removesuffix(".lock")
            for tmp in cache.glob(f".{name}.*"):
                if tmp.is_dir():
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp)
            lock_file.unlink(missing_ok=True)
            removed.append(lock_file)
    return removed


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """One entry of the model cache, as ``genserve cache list`` shows it."""

    path: Path
    size_bytes: int
    last_used: float  # seconds since the epoch
    sources: tuple[str, ...]
    kind: str  # gguf | bin | legacy

    @property
    def name(self) -> str:
        return self.path.name


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return total


def list_entries(cache: Path) -> list[CacheEntry]:
    """Complete entries of ``cache``, largest first (older genserve versions' entries,
    named ``<file stem>-<digest>``, are listed as ``legacy``)."""
    entries: list[CacheEntry] = []
    if not cache.is_dir():
        return entries
    for path in cache.iterdir():
        if path.name.startswith(".") or not path.is_dir() or not is_complete(path):
            continue
        record = read_record(path)
        marker = path / ENTRY_FILE if (path / ENTRY_FILE).is_file() else path / "config.json"
        kind = path.name.split("-", 1)[0] if (path / ENTRY_FILE).is_file() else "legacy"
        sources = record_sources(record)
        entries.append(CacheEntry(path, _size(path), marker.stat().st_mtime, sources, kind))
    return sorted(entries, key=lambda e: e.size_bytes, reverse=True)


def remove_entry(entry: CacheEntry) -> None:
    """Delete ``entry`` (a concurrent start rebuilds it)."""
    _discard(entry.path)


def digest_memo_dir(cache: Path) -> Path:
    return cache / _DIGESTS


def derived_memo_dir(cache: Path) -> Path:
    return cache / _DERIVED
