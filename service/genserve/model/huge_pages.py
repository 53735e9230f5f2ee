"""The weights a CPU decode step streams, moved into one region backed by 2 MiB pages.

Single-stream decode reads every weight once per step, a few hundred MB in 4 KiB pages: a
TLB miss and page walk every 4 KiB, and the cores' prefetchers stop at every page boundary.
Most Linux hosts run transparent huge pages in ``madvise`` mode, where only memory that asks
for them gets them, and torch's allocator does not ask.  So the weights are copied, once at
load, into one region that does ``madvise(MADV_HUGEPAGE)`` before its pages are first
touched.  Measured on the default model (runner_bench A/B, 2 AVX-512 cores): bf16 one
stream 88.4 -> 91.7 tok/s, gguf 32 streams 667 -> 693, float32 within noise.

The CPU KV pool gets huge pages the same way (:func:`zeros_on_huge_pages`): decode attention
reads each sequence's blocks scattered over it, one 4 KiB page per block and head otherwise.

Where THP is ``always`` the weights already have huge pages, where it is ``never`` (or on
another OS) madvise cannot help: both leave the tensors where they are.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

_HUGE_PAGE = 2 << 20
_ALIGN = 64  # a cache line: the kernels' vector loads
# Bytes placed between two trims of glibc's heap (see huge_page_region).
_TRIM_EVERY = 64 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Linux's MAP_NORESERVE (the mmap module does not export it); 0 elsewhere.
_MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0
# Linux 5.14's MADV_POPULATE_WRITE (Python 3.11's mmap does not export it); None elsewhere.
_MADV_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)


def thp_mode() -> str:
    """The kernel's transparent huge page mode (``always``, ``madvise``, ``never``), or
    ``""`` where there is none to read (not Linux)."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


class HugePageRegion:
    """``size`` bytes, 2 MiB-aligned and advised to the kernel as huge-page memory, handed
    out in 64-byte-aligned slices by :meth:`place`.  The region is a fresh anonymous mapping
    (not torch's allocator, which may hand back heap pages already touched, too late for the
    advice); its pages are committed as the slices are written, so placing tensors one at a
    time while dropping the originals keeps the peak near the weights plus one tensor."""

    def __init__(self, size: int) -> None:
        self._size = _round_up(max(size, 1), _HUGE_PAGE)
        # Private: a shared anonymous mapping is shmem, which THP in madvise mode skips.
        # No reserve: a region may be sized by an upper bound (pages never touched cost
        # nothing), which the kernel's overcommit heuristic must not count.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self._map = mmap.mmap(-1, self._size + _HUGE_PAGE, flags=flags)
        raw = torch.frombuffer(self._map, dtype=torch.uint8)  # shares the mapping
        offset = _round_up(raw.data_ptr(), _HUGE_PAGE) - raw.data_ptr()
        self._buffer = raw[offset : offset + self._size]
        self._offset = offset  # of the buffer in the mapping
        self._populate = _MADV_POPULATE_WRITE
        self._used = 0
        self._since_trim = 0
        self._ahead: _CommitAhead | None = None
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE, offset, self._size)
            self.advised = True
        except (AttributeError, OSError):  # no MADV_HUGEPAGE here
            self.advised = False

    def zeros(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes`` of the region as uint8, never written yet: zeros."""
        if self._used + nbytes > self._size:
            raise ValueError(f"region of {self._size} bytes is full")
        window = self._buffer[self._used : self._used + nbytes]
        self._used += _round_up(nbytes, _ALIGN)
        if self._ahead is not None:
            self._ahead.claim(self._used)
        return window

    def commit_ahead(self) -> None:
        """From now on, fault the region's pages in ahead of what :meth:`place` has used, in
        a thread of its own, until :meth:`stop_commit_ahead`.  Committing a 2 MiB page is the
        kernel's work (zeroing it, compacting memory to find it): 1-2.5 s of a 1B Q8_0 load
        on a 2-vCPU guest, which the thread overlaps with reading and packing the next
        matrices (partly single-threaded: numpy's copies, Python).  The thread stays at most
        a window ahead: 1/32 of the region, which is sized at twice the stored weights, so
        ~3% of them, and at most :data:`_AHEAD_WINDOW`; what it committed past the end of
        the last placed tensor is handed back when it stops.  The load's peak grows by that
        window at most (a 98 MiB Q8_0 file: 3 MiB; a 1B Q8_0 file: 64 MiB on ~1.9 GiB), the
        region's final size not at all."""
        if self._populate is None or self._ahead is not None:
            return
        libc = _libc()
        if libc is None or not hasattr(libc, "madvise"):
            return
        window = min(_AHEAD_WINDOW, _round_up(self._size // _AHEAD_FRACTION, _HUGE_PAGE))
        base = self._buffer.data_ptr()
        self._ahead = _CommitAhead(libc, base, self._size, self._populate, window)
        self._ahead.claim(self._used)

    def stop_commit_ahead(self) -> None:
        """Stops the thread and releases its pages past the end of what was placed."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        committed = ahead.stop()
        used = _round_up(self._used, _HUGE_PAGE)
        if committed > used:
            with contextlib.suppress(OSError):
                self._map.madvise(mmap.MADV_DONTNEED, self._offset + used, committed - used)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of the contiguous CPU ``tensor`` in the region (same dtype and shape), or
        ``tensor`` itself where the region has no room left for it (a region sized by an
        estimate never fails a load: what does not fit stays on small pages)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._used + nbytes > self._size:
            return tensor
        if self._since_trim >= _TRIM_EVERY:  # the originals placed so far are freed by now
            _malloc_trim()
            self._since_trim = 0
        start = self._used
        window = self.zeros(nbytes)
        self._commit(start, nbytes)
        self._since_trim += nbytes
        out = window.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def _commit(self, start: int, nbytes: int) -> None:
        """Fault the pages of buffer bytes ``[start, start + nbytes)`` in with one
        ``MADV_POPULATE_WRITE`` before the copy writes them: the copy then runs on mapped
        memory.  Measured here (600 MiB in 10 MiB tensors, 2 Zen 4 cores, THP madvise): the
        copy's own faults took 0.85-0.95 s, populate then copy 0.10-0.13 s, both all on
        2 MiB pages.  Only the slice is committed, so the load's peak is unchanged; a kernel
        without the advice (before Linux 5.14) leaves the faults to the copy."""
        if self._populate is None:
            return
        end = start + nbytes
        if self._ahead is not None:  # what the thread has committed already is skipped
            start = max(start, min(self._ahead.committed, end))
            if start >= end:
                return
        first = (self._offset + start) // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            self._map.madvise(self._populate, first, self._offset + end - first)
        except OSError:  # EINVAL: an older kernel; the copy faults the pages itself
            self._populate = None


# How far ahead of the writer the commit thread runs (a fraction of the region, at most a
# window), and how much it commits per call.
_AHEAD_FRACTION = 32
_AHEAD_WINDOW = 64 << 20
_AHEAD_CHUNK = 8 << 20


class _CommitAhead:
    """The thread of :meth:`HugePageRegion.commit_ahead`: ``MADV_POPULATE_WRITE`` over the
    buffer at ``base`` (2 MiB-aligned) in :data:`_AHEAD_CHUNK` steps, from its start up to
    ``window`` bytes past the writer's claim.  Through ctypes, which releases the GIL
    for the call (``mmap.madvise`` holds it).  Committing a page the writer is writing, or
    one it committed itself, changes nothing: populate only faults pages not present."""

    def __init__(self, libc: ctypes.CDLL, base: int, size: int, advice: int, window: int) -> None:
        self._madvise = libc.madvise
        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._madvise.restype = ctypes.c_int
        self._base, self._size, self._advice, self._window = base, size, advice, window
        self._lock = threading.Condition()
        self._claimed = 0
        self._stopped = False
        self.committed = 0  # bytes from the buffer's start; read without the lock (an int)
        self._thread = threading.Thread(target=self._run, name="genserve-commit", daemon=True)
        self._thread.start()

    def claim(self, used: int) -> None:
        with self._lock:
            self._claimed = used
            self._lock.notify()

    def stop(self) -> int:
        """Stops and joins the thread; returns the bytes it committed."""
        with self._lock:
            self._stopped = True
            self._lock.notify()
        self._thread.join()
        return self.committed

    def _target(self) -> int:
        return min(self._claimed + self._window, self._size)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and self.committed >= self._target():
                    self._lock.wait()
                if self._stopped:
                    return
                end = min(self.committed + _AHEAD_CHUNK, self._target())
            start = self.committed
            if self._madvise(self._base + start, end - start, self._advice) != 0:
                return  # an older kernel (EINVAL): the writer commits its own pages
            self.committed = end


@contextmanager
def huge_page_region(sizes: list[int], device: torch.device) -> Iterator[HugePageRegion | None]:
    """A region that holds tensors of ``sizes`` bytes where moving them to huge pages can
    help (Linux, THP in ``madvise`` mode, CPU tensors), else None: the caller keeps its
    tensors.  Sizes, not the tensors, so that each original can be freed once placed."""
    if device.type != "cpu" or not _advice_helps() or not sizes:
        yield None
        return
    region = HugePageRegion(sum(_round_up(size, _ALIGN) for size in sizes))
    if region.advised:
        region.commit_ahead()
    try:
        yield region if region.advised else None
    finally:
        region.stop_commit_ahead()
    # The originals were mostly small enough for glibc to serve from its heap, whose freed
    # middle it keeps mapped: without a trim the process would hold the weights twice.
    _malloc_trim()


def release_freed_heap() -> None:
    """Hand the pages of freed heap blocks back to the OS (glibc ``malloc_trim``; nothing
    elsewhere).  Loading frees large tensors (a matrix's stored form once it is packed)
    that glibc would keep mapped: trimmed before the next large allocation, the peak
    resident size holds them once, not twice."""
    _malloc_trim()


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zero CPU tensor in its own huge-page region, or None where the advice cannot help
    (as for :func:`huge_page_region`).  Anonymous memory reads as zeros and is committed as
    it is first written, so a large tensor costs nothing until it is used (2 MiB at a
    time)."""
    if not _advice_helps():
        return None
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = HugePageRegion(nbytes)
    if not region.advised:
        return None
    return region.zeros(nbytes).view(dtype).view(shape)


def _advice_helps() -> bool:
    """Linux with THP in ``madvise`` mode: the only place where asking for huge pages
    changes anything (``always`` gives them anyway, ``never`` refuses)."""
    return sys.platform.startswith("linux") and thp_mode() == "madvise"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once: ``find_library`` runs ``ldconfig -p`` in a subprocess
    (a fork of a process holding GBs of weights), and a load trims after every 64 MiB placed
    and every layer (measured: 0.9 s of an F16 1B start's packing went to these lookups)."""
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name, use_errno=True)


def _malloc_trim() -> None:
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim(0)
