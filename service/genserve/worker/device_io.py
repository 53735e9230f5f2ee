"""Moving a step's data between the host and the device without stalling the host.

The contract every sync-free path of the worker keeps (issue #29):

* Host → device: :func:`upload` — values built on the host go into a pinned staging tensor
  (page-locked memory from torch's caching host allocator, reused across steps) and are copied
  with ``non_blocking=True``, so the host queues the copy and moves on.  Nothing reads a
  device tensor back to decide what to upload.
* Device → host: :class:`Readback` — one packed copy per step into a pinned buffer allocated
  once, followed by one wait on an event recorded after it (the step's only synchronisation).
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


class Readback:
    """The step's single device → host copy: a float32 ``[rows, columns]`` block copied into
    a pinned buffer kept across steps (grown when a step needs more), then one wait."""

    def __init__(self, io: DeviceIO) -> None:
        self._io = io
        self._buffer: torch.Tensor | None = None

    def fetch(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` (on the device) as a host tensor, valid until the next call."""
        if not self._io.transfers:
            return packed
        numel = packed.numel()
        if (
            self._buffer is None
            or self._buffer.numel() < numel
            or self._buffer.dtype != packed.dtype
        ):
            size = 1 << max(10, (numel - 1).bit_length())
            self._buffer = host_buffer((size,), packed.dtype, self._io.device)
        out = self._buffer[:numel].view(packed.shape)
        out.copy_(packed, non_blocking=True)
        if self._io.device.type == "cuda":
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record()
            done.synchronize()  # the step's one wait: everything queued before is finished
        return out
