"""A step's attention metadata sent to the device in one asynchronous copy.

The torch backend describes a step with a handful of small integer arrays (slots, block
tables, positions, query offsets...).  Each used to be its own ``torch.tensor(...,
device=)`` / ``.to(device)``: on CUDA a blocking copy from pageable memory, i.e. the host
waiting for everything queued before it, once per array and step.  :class:`HostPack`
concatenates them on the host into one int64 array and hands it to an :data:`Upload`
(pinned + ``non_blocking`` on CUDA; the runner passes its ``DeviceIO.upload_tensor`` so the
CPU proof test sees the copy); the arrays come back as views of the one device tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# A host tensor → the same values on the device, queued without waiting.
Upload = Callable[[torch.Tensor], torch.Tensor]


def default_upload(device: torch.device) -> Upload:
    """Pinned memory and a ``non_blocking`` copy on CUDA; the tensor itself on the CPU."""
    if device.type == "cpu":
        return lambda host: host

    def upload(host: torch.Tensor) -> torch.Tensor:
        if torch.cuda.is_available():
            host = host.pin_memory()  # torch's caching host allocator: reused, event-guarded
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        out.copy_(host, non_blocking=True)
        return out

    return upload


class HostPack:
    """Named int64 arrays gathered on the host, uploaded together by :meth:`upload`."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._shapes: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._size = 0

    def add(self, name: str, values: np.ndarray) -> None:
        flat = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
        self._shapes[name] = (self._size, flat.size, tuple(values.shape))
        self._parts.append(flat)
        self._size += flat.size

    def upload(self, upload: Upload) -> dict[str, torch.Tensor]:
        """Every array added, as a view of one device tensor (one copy)."""
        host = np.concatenate(self._parts) if self._parts else np.zeros(0, dtype=np.int64)
        device = upload(torch.from_numpy(host))
        return {
            name: device[start : start + size].view(shape)
            for name, (start, size, shape) in self._shapes.items()
        }
