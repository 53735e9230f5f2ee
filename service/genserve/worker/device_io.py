"""Moving a step's data between the host and the device without stalling the host.

The contract every sync-free path of the worker keeps (issue #29):

* Host → device: :func:`upload` — values built on the host go into a pinned staging tensor
  (page-locked memory from torch's caching host allocator, reused across steps) and are copied
  with ``non_blocking=True``, so the host queues the copy and moves on.  Nothing reads a
  device tensor back to decide what to upload.
* Device → host: :class:`Readback` — one packed copy per step into a pinned buffer allocated
  once (two, used in turn), followed by one wait on an event recorded after it (the step's
  only synchronisation), which may come after the next step was launched.
* Host staging buffers that live across steps come from :func:`host_buffer` (pinned when CUDA
  is present), so the proof test can tell them from device tensors when "the device" is the CPU.

On a CPU device the same calls run with the copies made explicit (an ``empty`` on the device
and a ``copy_``) only when ``explicit`` is set — the proof test's emulation of a separate
device; otherwise a CPU upload is just the tensor, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Buffers made by host_buffer(): the proof test treats them as host memory.
HOST_BUFFERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def pin_available(device: torch.device) -> bool:
    """Pinned memory only helps (and only exists) with a CUDA device."""
    return device.type == "cuda" and torch.cuda.is_available()


def host_buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host staging tensor for copies to/from ``device``, allocated once by its
    owner: pinned when ``device`` is a CUDA device."""
    buffer = torch.zeros(tuple(shape), dtype=dtype, pin_memory=pin_available(device))
    HOST_BUFFERS[buffer] = True
    return buffer


class DeviceIO:
    """Uploads and the step's readback for one device.

    ``explicit``: on a CPU device, still make every transfer an explicit copy (the proof
    test's emulation of a discrete device).  Ignored on CUDA, where transfers are real."""

    def __init__(self, device: torch.device, explicit: bool = False) -> None:
        self.device = device
        self.transfers = device.type != "cpu" or explicit
        self._pin = pin_available(device)
        self.num_uploads = 0  # host → device uploads made (the counting tests read it)
        self._cached: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}

    def upload(
        self, values: Sequence[float] | Sequence[int] | Sequence[bool], dtype: torch.dtype
    ) -> torch.Tensor:
        """``values`` as a ``[len(values)]`` tensor on the device, copied asynchronously."""
        host = torch.tensor(values, dtype=dtype)
        return self.upload_tensor(host)

    def upload_tensor(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device (pinned first on CUDA, copied asynchronously)."""
        self.num_uploads += 1
        if not self.transfers:
            return host
        if self._pin:
            host = host.pin_memory()
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        out.copy_(host, non_blocking=True)
        return out

    def upload_cached(self, name: str, values: Sequence[int]) -> torch.Tensor:
        """``values`` as an int64 device tensor, reusing the one uploaded under ``name``
        last time when the values are the same (a steady batch's row indices: no upload
        per step).  The result is shared: callers must not write to it."""
        key = tuple(values)
        cached = self._cached.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        tensor = self.upload(key, torch.int64)
        self._cached[name] = (key, tensor)
        return tensor


class PendingRead:
    """A readback in flight: the copy into a pinned host buffer is queued, with an event
    recorded after it; :meth:`wait` is the step's one synchronisation."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self._host = host
        self._done = done

    def wait(self) -> torch.Tensor:
        """The host copy, once the device has written it (valid until the readback after
        next: two buffers are used in turn)."""
        if self._done is not None:
            self._done.synchronize()  # everything queued before the copy is finished
            self._done = None
        return self._host


class Readback:
    """The step's single device → host copy: a float32 ``[rows, columns]`` block copied into
    one of two pinned buffers kept across steps (grown when a step needs more), then one
    wait on an event.

    Two buffers, used in turn, so that step *n + 1* can queue its copy before step *n*'s
    was read (the step thread launches *n + 1* before collecting *n*: ``ModelRunner.launch``
    / ``collect``); a step's buffer is reused two readbacks later, by which time the runner
    has collected it (it keeps at most one step uncollected)."""

    def __init__(self, io: DeviceIO) -> None:
        self._io = io
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._next = 0

    def start(self, packed: torch.Tensor) -> PendingRead:
        """Queue the copy of ``packed`` (on the device) to the host; wait with
        :meth:`PendingRead.wait`."""
        if not self._io.transfers:
            # The CPU path: nothing to copy, unless ``packed`` is a view of a buffer the
            # next step rewrites before this one is collected (the graphs' static outputs).
            return PendingRead(packed.clone() if packed._base is not None else packed, None)
        numel = packed.numel()
        buffer = self._buffers[self._next]
        if buffer is None or buffer.numel() < numel or buffer.dtype != packed.dtype:
            # Both at once (a steady step allocates nothing); the other one may still be
            # read, so it is replaced, not written.
            size = 1 << max(10, (numel - 1).bit_length())
            self._buffers = [host_buffer((size,), packed.dtype, self._io.device) for _ in "ab"]
            buffer = self._buffers[self._next]
        assert buffer is not None
        self._next ^= 1
        out = buffer[:numel].view(packed.shape)
        out.copy_(packed, non_blocking=True)
        done = None
        if self._io.device.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
        return PendingRead(out, done)

    def fetch(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` (on the device) as a host tensor: :meth:`start` and wait at once."""
        return self.start(packed).wait()
