"""Installing LoRA adapters into the model's LoRA slots: this rank's slice of an adapter
read by :mod:`genserve.model.adapter_files`, laid out per projection, copied into a slot;
:class:`AdapterSlots` is the runner's record of what each slot holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from genserve.model.adapter_files import AdapterWeights, read_adapter
from genserve.model.config import ModelConfig
from genserve.model.lora import LoraHook, ModuleSplit, SlotWeights, StepAdapters, slice_pair
from genserve.step import AdapterRef

Targets = dict[str, tuple[LoraHook, ModuleSplit]]


@dataclass(frozen=True, slots=True)
class PreparedAdapter:
    """One adapter as this rank's per-projection slot contents (:class:`SlotWeights`, in the
    model's dtype and on its device), ready for a cheap copy into a slot."""

    adapter_id: str
    per_hook: dict[int, SlotWeights]  # id(hook) -> weights; absent: not targeted


def _hook_widths(targets: Targets) -> dict[int, int]:
    """Each hook's local output width (its pieces' rows, summed over the fused matrices)."""
    widths: dict[int, int] = {}
    for hook, split in targets.values():
        rows = sum(stop - start for start, stop in split.out_rows)
        widths[id(hook)] = max(widths.get(id(hook), 0), split.out_lo + rows)
    return widths


def prepare(
    adapter: AdapterWeights, targets: Targets, dtype: torch.dtype, device: torch.device
) -> PreparedAdapter:
    """Slice ``adapter`` for this rank and lay it out per projection: the A of every piece
    it adapts stacked (one shrink for q/k/v or gate/up), Bᵀ·scale block-diagonal (one
    expand writes each piece's columns).  Heavy (reads, copies, converts): run it off the
    step thread."""
    widths = _hook_widths(targets)
    pieces: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for path, (a, b, scale) in adapter.modules.items():
        hook, split = targets[path]
        a_local, b_local = slice_pair(a, b, split)
        pieces.setdefault(id(hook), []).append((split.out_lo, a_local, b_local * scale))
    per_hook: dict[int, SlotWeights] = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        rank = sum(part[1].shape[0] for part in parts)
        b_block = torch.zeros(rank, widths[key], dtype=torch.float32)
        cols = torch.zeros(rank, 2, dtype=torch.int32)
        row = 0
        for lo, a_local, b_scaled in parts:
            r = a_local.shape[0]
            hi = lo + b_scaled.shape[0]
            b_block[row : row + r, lo:hi] = b_scaled.t()
            cols[row : row + r, 0] = lo
            cols[row : row + r, 1] = hi
            row += r
        a_cat = torch.cat([part[1] for part in parts], dim=0)
        per_hook[key] = SlotWeights(
            a_cat.to(device=device, dtype=dtype).contiguous(),
            b_block.to(device=device, dtype=dtype).contiguous(),
            cols.to(device=device),
        )
    return PreparedAdapter(adapter.adapter_id, per_hook)


def install(prepared: PreparedAdapter, slot: int, targets: Targets, step: StepAdapters) -> None:
    """Copy ``prepared`` into ``slot`` of every hook (replacing what the slot held): the
    cheap part, done on the step thread.  Hooks it does not target get a zero slot."""
    step.num_slots = max(step.num_slots, slot + 1)
    hooks = {id(hook): hook for hook, _ in targets.values()}
    for key, hook in hooks.items():
        hook.set_slot(slot, prepared.per_hook.get(key))


# Adapters prepared ahead of their first step (requests cancelled meanwhile leave entries).
_MAX_PREPARED_ADAPTERS = 16


class AdapterSlots:
    """A runner's LoRA slots: which adapter each holds, and adapters prepared ahead.

    The model's LoRA hooks are attached on the first adapter request (base-only serving pays
    nothing).  :meth:`prepare` reads and lays out an adapter off the step thread (thread-safe:
    the engine calls it while steps run); :meth:`ensure`, on the step thread, makes a slot
    hold an adapter - a copy of what was prepared, or (a shard worker, a test driving the
    runner directly) read and prepared there and then.  ``step`` tells the hooks which slot
    each token row of a step uses."""

    def __init__(
        self,
        enable_lora: Callable[[StepAdapters], Targets],
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self._enable_lora = enable_lora
        self._config = config
        self._dtype = dtype
        self._device = device
        self.step = StepAdapters()
        self.targets: Targets | None = None  # None until the hooks are attached
        self._slot_ids: dict[int, str] = {}
        # By (id, path), waiting for their first step; bounded for cancelled requests.
        self._prepared: OrderedDict[tuple[str, str], PreparedAdapter] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def attached(self) -> bool:
        """Whether the model's hooks are attached (some adapter was asked for)."""
        return self.targets is not None

    def prepare(self, ref: AdapterRef) -> None:
        """Read, validate and lay out ``ref``'s adapter for its slot, so that the step that
        first runs it only copies tensors.  Raises
        :class:`~genserve.model.adapter_errors.AdapterError` for an adapter that does not fit."""
        key = (ref.adapter_id, ref.path)
        with self._lock:
            if self._slot_ids.get(ref.slot) == ref.adapter_id or key in self._prepared:
                return
            targets = self._attach()
        weights = read_adapter(ref.adapter_id, Path(ref.path), self._config)
        prepared = prepare(weights, targets, self._dtype, self._device)
        with self._lock:
            self._prepared[key] = prepared
            while len(self._prepared) > _MAX_PREPARED_ADAPTERS:
                self._prepared.popitem(last=False)

    def ensure(self, ref: AdapterRef) -> None:
        """Make slot ``ref.slot`` hold ``ref.adapter_id`` (step thread)."""
        if self._slot_ids.get(ref.slot) == ref.adapter_id:
            return
        with self._lock:
            targets = self._attach()
            prepared = self._prepared.pop((ref.adapter_id, ref.path), None)
        if prepared is None:
            weights = read_adapter(ref.adapter_id, Path(ref.path), self._config)
            prepared = prepare(weights, targets, self._dtype, self._device)
        install(prepared, ref.slot, targets, self.step)
        self._slot_ids[ref.slot] = ref.adapter_id

    def _attach(self) -> Targets:
        """The model's LoRA hooks, attached on first use.  Attaching is safe while a step
        runs: hooks do nothing until the runner marks rows."""
        if self.targets is None:
            from genserve.kernels import cpu as cpu_kernels

            # The BGMV kernel computes every row's delta in one op per projection; without
            # it (GPU, no compiler, --disable-cpu-kernels) the batched torch path runs.
            self.step.use_kernel = self._device.type == "cpu" and cpu_kernels.load()
            self.targets = self._enable_lora(self.step)
        return self.targets
