"""Counting what a step would make a GPU wait for, on a machine without one (issue #29).

The runner runs its CUDA code path on the CPU (``explicit_transfers``: every host → device
transfer an explicit copy, sampling without value-dependent branches) under
:class:`SyncAudit`, a ``TorchDispatchMode`` that sees every aten op and keeps one bit per
tensor: *device* or *host*.

* Device tensors: the ones handed in (model parameters and buffers, KV cache, graph buffers,
  any tensor alive before the audit that is not a registered host staging buffer), every
  factory op's output (``zeros``, ``empty``, ``arange``: the runner creates them on its
  device), and every output of an op with a device input.
* Host tensors: tensors made from Python data or numpy (``lift_fresh``), staging buffers from
  :func:`genserve.worker.device_io.host_buffer`, and outputs of ops on host tensors only.

What it records, as a GPU would see it:

* ``h2d`` / ``h2d_blocking``: ``copy_`` host → device (blocking unless ``non_blocking``).
* ``d2h``: ``copy_`` device → host (a wait for everything queued before).
* ``implicit``: an op mixing a device tensor with a host tensor that is not a 0-dim scalar
  (on CUDA an error or a hidden blocking copy, e.g. ``torch.tensor(list, device=cuda)``).
* ``syncs``: ops whose result the host needs (``item``, ``is_nonzero`` from ``bool()``,
  ``nonzero``, boolean-mask indexing, ...) on a device tensor, and ``tolist()`` / ``numpy()``
  of a device tensor (patched while the audit runs: they do not dispatch on the CPU).
* ``kernels``: ops that would launch a kernel (not views, allocations or metadata), in total
  and per decoder layer when a layer module is given.  A custom op (the Triton kernels'
  ``genserve_gpu::*`` ops, a stubbed kernel) is one op here, as it is one launch on a GPU.
  With ``graphs`` (a ``DecodeGraphs``), the kernels of what its CUDA graphs hold (the
  forward + LM head, the greedy and sampled tails) are counted apart too: the rest is what
  runs eagerly.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from genserve.worker.device_io import HOST_BUFFERS

# Ops whose result the host must read (a device → host synchronisation on CUDA).
_SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
    "aten.equal",
    "aten.unique_dim",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.bincount",
    "aten.allclose",
}
# Ops that launch no kernel: allocations, lifting Python data, metadata.
_NOT_KERNELS = {
    "aten.empty",
    "aten.empty_strided",
    "aten.empty_like",
    "aten.lift_fresh",
    "aten.detach_",
    "aten.detach",
    "aten.alias",
    "aten._local_scalar_dense",
    "aten.item",
    "aten.is_nonzero",
    "aten.resolve_conj",
    "aten.resolve_neg",
    "aten.sym_size",
    "aten.sym_stride",
    "aten.sym_numel",
}


def _name(func: Any) -> str:
    return str(func.overloadpacket._qualified_op_name).replace("::", ".")


@dataclass
class AuditCounts:
    h2d: int = 0
    h2d_blocking: int = 0
    d2h: int = 0
    implicit: int = 0
    syncs: int = 0
    kernels: int = 0
    layer_kernels: int = 0
    graph_kernels: int = 0  # inside what DecodeGraphs captures (see SyncAudit's graphs)
    details: Counter[str] = field(default_factory=Counter)  # "kind:op" → count

    def summary(self) -> dict[str, int]:
        return {
            "h2d": self.h2d,
            "h2d_blocking": self.h2d_blocking,
            "d2h": self.d2h,
            "implicit": self.implicit,
            "syncs": self.syncs,
            "kernels": self.kernels,
            "layer_kernels": self.layer_kernels,
            "graph_kernels": self.graph_kernels,
        }


class SyncAudit(TorchDispatchMode):
    """``with SyncAudit(device_tensors, host_tensors, layer) as audit: step()`` then read
    ``audit.counts``.  ``layer``: a module whose forward's ops are also counted apart (its
    ``forward``, or ``forward_carry`` where the model's fused GPU path calls that)."""

    _LAYER_METHODS = ("forward", "forward_carry")
    # DecodeGraphs: what a bucket captures
    _GRAPH_METHODS = ("_forward", "_greedy_tail", "_sampled_tail")

    def __init__(
        self,
        device_tensors: Iterable[torch.Tensor] = (),
        host_tensors: Iterable[torch.Tensor] = (),
        layer: torch.nn.Module | None = None,
        graphs: object | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts = AuditCounts()
        self._device: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._host: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in device_tensors:
            self._device[t] = True
        for t in host_tensors:
            self._host[t] = True
        self._in_layer = False
        self._in_graph = False
        self._layer = layer
        self._graphs = graphs
        self._patched: list[tuple[str, Any]] = []

    # ------------------------------------------------------------------ classification
    def is_device(self, t: torch.Tensor) -> bool:
        for x in (t, t._base):
            if x is None:
                continue
            if x in HOST_BUFFERS or x in self._host:
                return False
            if x in self._device:
                return True
        return True  # alive before the audit and not a host buffer: the runner's device state

    def _record(self, kind: str, op: str) -> None:
        self.counts.details[f"{kind}:{op}"] += 1

    # ----------------------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        known = [(t, self._classify(t)) for t in tensors]
        out = func(*args, **kwargs)
        c = self.counts
        if name == "aten.lift_fresh":
            self._mark(out, device=False)
            return out
        if name == "aten.copy_":
            dst_dev, src_dev = known[0][1], known[1][1]
            non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking"))
            if dst_dev and not src_dev:
                c.h2d += 1
                if not non_blocking:
                    c.h2d_blocking += 1
                    self._record("h2d_blocking", name)
            elif src_dev and not dst_dev:
                c.d2h += 1
                self._record("d2h", name)
            if dst_dev or src_dev:
                c.kernels += 1
                c.layer_kernels += self._in_layer
                c.graph_kernels += self._in_graph
                if self._graphs is not None and not self._in_graph:
                    self._record("outside_graph", name)
            return out
        any_device = any(d for _, d in known)
        if name in _SYNC_OPS and any_device:
            c.syncs += 1
            self._record("sync", name)
        if name == "aten.index" and any_device:
            indices = args[1] if len(args) > 1 else []
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in indices
            ):
                c.syncs += 1
                self._record("sync", "aten.index[bool]")
        if any_device and any(
            not d and (t.dim() > 0) for t, d in known
        ):  # a host array inside a device op
            c.implicit += 1
            self._record("implicit", name)
        factory = not tensors
        is_kernel = (
            (any_device or factory)
            and name not in _NOT_KERNELS
            and not getattr(func, "is_view", False)
        )
        if is_kernel:
            c.kernels += 1
            c.layer_kernels += self._in_layer
            c.graph_kernels += self._in_graph
            self._record("kernel", name)
            if self._graphs is not None and not self._in_graph:
                self._record("outside_graph", name)
        self._mark(out, device=any_device or factory)
        return out

    def _classify(self, t: torch.Tensor) -> bool:
        return self.is_device(t)

    def _mark(self, out: Any, device: bool) -> None:
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                (self._device if device else self._host)[t] = True

    # ------------------------------------------------------------- tolist / numpy / enter
    def __enter__(self) -> SyncAudit:
        audit = self
        for method in ("tolist", "numpy"):
            original = getattr(torch.Tensor, method)

            def patched(t: torch.Tensor, *a: Any, _orig: Any = original, _m: str = method) -> Any:
                if audit.is_device(t):
                    audit.counts.syncs += 1
                    audit._record("sync", f"Tensor.{_m}")
                return _orig(t, *a)

            self._patched.append((method, original))
            setattr(torch.Tensor, method, patched)
        layer = self._layer
        if layer is not None:
            # The model calls ``layer.forward`` directly (no module hooks): wrap the bound
            # methods on the instance for the audit's duration.
            for name in self._LAYER_METHODS:
                if hasattr(layer, name):
                    setattr(layer, name, self._counted(getattr(layer, name), "_in_layer"))
        if self._graphs is not None:
            for name in self._GRAPH_METHODS:
                setattr(self._graphs, name, self._counted(getattr(self._graphs, name), "_in_graph"))
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def _counted(self, method: Any, flag: str) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            setattr(self, flag, True)
            try:
                return method(*a, **kw)
            finally:
                setattr(self, flag, False)

        return counted

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for method, original in self._patched:
            setattr(torch.Tensor, method, original)
        self._patched.clear()
        for target, names in (
            (self._layer, self._LAYER_METHODS),
            (self._graphs, self._GRAPH_METHODS),
        ):
            for name in names if target is not None else ():
                if name in vars(target):
                    delattr(target, name)
