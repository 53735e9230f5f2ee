"""Multi-LoRA: per-row low-rank deltas added to the base projections, never merged into them.

One step may mix rows of many adapters (and of the base model).  The runner describes which
rows use which adapter slot in :class:`StepAdapters` (one segment per slot: the row indices
that share it); each hooked projection then, per segment, gathers its rows, runs the two
low-rank matmuls ``x Aᵀ Bᵀ · scale`` (S-LoRA / punica's SGMV, written as gathered torch
matmuls) and ``index_add``s the result into the base output.  Rows of the base model are
never touched, and a step with no adapter rows pays one empty-list check per projection.

Tensor parallelism follows the base layers: a column-parallel projection (q/k/v, gate/up)
keeps the *rows of B* that match its output slice (A whole); a row-parallel projection
(o, down) keeps the *columns of A* that match its input slice (B whole), and its delta is a
partial sum added before the layer's existing all-reduce: ``Σ_ranks x_r A_rᵀ Bᵀ = x Aᵀ Bᵀ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# PEFT's module names and the genserve projection each one lives in.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES


class AdapterError(ValueError):
    """An adapter that does not fit the base model (or cannot be read); names the mismatch."""


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(slots=True)
class StepAdapters:
    """Which rows of the current step use which adapter slot; set by the runner per step."""

    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (slot, row index)

    def set_rows(self, row_slots: Sequence[int], device: torch.device) -> None:
        """``row_slots[i]``: the slot of row ``i``, or -1 for the base model."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        self.segments = [
            (slot, torch.tensor(rows, dtype=torch.int64, device=device))
            for slot, rows in sorted(by_slot.items())
        ]


@dataclass(frozen=True, slots=True)
class LoraPiece:
    """One adapted logical matrix inside a (possibly fused) projection: output columns
    ``[lo, hi)`` get ``x Aᵀ Bᵀ · scale``; ``a`` is ``[r, in_local]``, ``b`` ``[hi - lo, r]``."""

    lo: int
    hi: int
    a: torch.Tensor
    b: torch.Tensor
    scale: float


class LoraHook:
    """Attached to one projection; holds every loaded adapter's pieces for it, by slot."""

    def __init__(self, step: StepAdapters) -> None:
        self.step = step
        self.slots: dict[int, list[LoraPiece]] = {}

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``x``) with each adapter row's delta added in place."""
        for slot, rows in self.step.segments:
            pieces = self.slots.get(slot)
            if not pieces:
                continue
            xs = x.index_select(0, rows)  # [n, in_local]
            for p in pieces:
                delta = (xs @ p.a.t()) @ p.b.t()  # [n, hi - lo]
                y[:, p.lo : p.hi].index_add_(0, rows, delta, alpha=p.scale)
        return y


@dataclass(frozen=True, slots=True)
class ModuleSplit:
    """How one PEFT module maps onto a genserve projection of this rank.

    ``out_rows`` are the rows of B (output features) this rank keeps, as ranges, and
    ``out_lo`` where they start in the fused output; ``in_range`` the columns of A (input
    features) this rank keeps (None: all of them)."""

    out_rows: tuple[tuple[int, int], ...]
    out_lo: int
    in_range: tuple[int, int] | None = None


def slice_pair(
    a: torch.Tensor, b: torch.Tensor, split: ModuleSplit
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``(A, B)`` of one module under ``split``."""
    if split.in_range is not None:
        a = a[:, split.in_range[0] : split.in_range[1]]
    b = torch.cat([b[start:stop] for start, stop in split.out_rows], dim=0)
    return a.contiguous(), b.contiguous()
