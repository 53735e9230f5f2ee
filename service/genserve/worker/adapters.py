"""Installing LoRA adapters into the model's LoRA slots: this rank's slice of an adapter
read by :mod:`genserve.model.adapter_files`, laid out per projection, copied into a slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.model.adapter_files import AdapterWeights
from genserve.model.adapter_files import read_adapter as read_adapter  # the runner's import
from genserve.model.lora import LoraHook, ModuleSplit, SlotWeights, StepAdapters, slice_pair

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
