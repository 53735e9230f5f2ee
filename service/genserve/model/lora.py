"""Multi-LoRA: per-row low-rank deltas added to the base projections, never merged into them.

One step may mix rows of many adapters (and of the base model).  Every loaded adapter lives
in a *slot*; each hooked projection keeps all slots' matrices stacked, padded to one rank
(punica / S-LoRA / vLLM's punica wrapper):

* ``a``: ``[slots, P·R, in]`` — the A of each of the projection's ``P`` pieces (q/k/v of the
  fused QKV projection, gate/up of the fused MLP projection, or just one), one rank block
  of ``R`` rows per piece, so a single *shrink* matmul serves every piece that shares the
  input;
* ``b``: ``[slots, P·R, out]`` — Bᵀ·scale, block-diagonal over the pieces (piece ``p``'s
  rank block writes only its own output columns), so a single *expand* matmul writes the
  deltas of q, k and v (or gate and up) at once.

The runner describes the step once (:meth:`StepAdapters.set_rows`): which slots it uses and,
for each, its rows padded to the longest segment.  A projection's delta is then a fixed
handful of ops whatever the number of adapters (SGMV as batched matmuls): gather the rows
``[U, L, in]``, ``bmm`` with the used slots' A, zero the padding rows, ``bmm`` with their B,
``index_add_`` into the base output.  When padding would waste more than it saves (a long
prefill chunk next to single decode rows) the step runs one segment at a time instead.
Rows of the base model are never touched, and a step without adapter rows pays one check.

Installing an adapter is a copy into its slot of tensors prepared beforehand
(:func:`genserve.worker.adapters.prepare`, off the step thread); the stacks grow (rarely:
more slots or a larger rank than any before) by reallocation at install time, never per step.

Tensor parallelism follows the base layers: a column-parallel projection (q/k/v, gate/up)
keeps the *rows of B* that match its output slice (A whole); a row-parallel projection
(o, down) keeps the *columns of A* that match its input slice (B whole), and its delta is a
partial sum added before the layer's existing all-reduce: ``Σ_ranks x_r A_rᵀ Bᵀ = x Aᵀ Bᵀ``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# PEFT's module names and the genserve projection each one lives in.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES

# Batched (padded) segments are used while the padded row count stays within this factor of
# the real one; beyond it (a long prefill beside short segments) segments run one by one.
_MAX_PADDING_FACTOR = 2.0


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class StepAdapters:
    """Which rows of the current step use which adapter slot; set by the runner per step and
    shared by every hook, so the per-step index work is done once, not per projection."""

    def __init__(self, use_kernel: bool = False) -> None:
        # torch.ops.genserve.lora_bgmv_ (CPU, genserve.kernels): one op per projection.
        self.use_kernel = use_kernel
        self.row_slot: torch.Tensor | None = None  # [rows] int64, -1: base model (kernel)
        self.active = False  # any adapter rows this step
        self.batched = False  # padded segments (True) or one segment at a time (False)
        self.used: torch.Tensor | None = None  # [U] slots this step uses
        self.pad_rows: torch.Tensor | None = None  # [U·L] row of each padded position
        self.pad_mask: torch.Tensor | None = None  # [U, L, 1] 1 for real rows, 0 for padding
        self.seg_len = 0  # L
        self.segments: list[tuple[int, torch.Tensor]] = []  # (slot, rows), unbatched steps
        self._mask_cache: dict[torch.dtype, torch.Tensor] = {}
        # Slots the runner has installed adapters into (max index + 1): every hook's stacks
        # cover them all, so a step's slot indices are valid for every projection.
        self.num_slots = 0

    def set_rows(self, row_slots: Sequence[int], device: torch.device) -> None:
        """``row_slots[i]``: the slot of row ``i``, or -1 for the base model."""
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        self._mask_cache = {}
        self.active = bool(by_slot)
        if not by_slot:
            self.batched = False
            self.segments = []
            return
        if self.use_kernel:
            self.row_slot = torch.tensor(list(row_slots), dtype=torch.int64, device=device)
            return
        slots = sorted(by_slot)
        seg_len = max(len(rows) for rows in by_slot.values())
        num_rows = sum(len(rows) for rows in by_slot.values())
        self.batched = len(slots) * seg_len <= _MAX_PADDING_FACTOR * num_rows
        if not self.batched:
            self.segments = [
                (slot, torch.tensor(by_slot[slot], dtype=torch.int64, device=device))
                for slot in slots
            ]
            return
        self.segments = []
        # Padding positions read row 0 and are zeroed after the shrink, so their (zero) delta
        # may be added back to row 0 harmlessly: no masking of the output is needed.
        pad_rows = [0] * (len(slots) * seg_len)
        mask = [0.0] * (len(slots) * seg_len)
        for u, slot in enumerate(slots):
            for j, row in enumerate(by_slot[slot]):
                pad_rows[u * seg_len + j] = row
                mask[u * seg_len + j] = 1.0
        self.seg_len = seg_len
        self.used = torch.tensor(slots, dtype=torch.int64, device=device)
        self.pad_rows = torch.tensor(pad_rows, dtype=torch.int64, device=device)
        self.pad_mask = torch.tensor(mask, dtype=torch.float32, device=device).view(
            len(slots), seg_len, 1
        )

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The padding mask in ``dtype`` (converted once per step, not per projection)."""
        assert self.pad_mask is not None
        cached = self._mask_cache.get(dtype)
        if cached is None:
            cached = self._mask_cache[dtype] = self.pad_mask.to(dtype)
        return cached


@dataclass(frozen=True, slots=True)
class SlotWeights:
    """One adapter's matrices for one hook, ready to copy into a slot: ``a`` ``[P·r, in]``
    (piece ``p``'s A in rows ``[p·r, (p+1)·r)``, zero for pieces it does not adapt) and
    ``b`` ``[P·r, out]`` (Bᵀ·scale, block-diagonal over the pieces)."""

    a: torch.Tensor
    b: torch.Tensor
    # [P·r, 2] int32: the non-zero columns [lo, hi) of each row of ``b`` (its piece's
    # output range), which lets the CPU kernel skip the block-diagonal zeros.
    cols: torch.Tensor

    @property
    def rank(self) -> int:
        return self.a.shape[0]


class LoraHook:
    """Attached to one projection; holds every loaded adapter's stacked A and B, by slot."""

    def __init__(self, step: StepAdapters) -> None:
        self.step = step
        self.a: torch.Tensor | None = None  # [slots, P·R, in]
        self.b: torch.Tensor | None = None  # [slots, P·R, out]
        self.cols: torch.Tensor | None = None  # [slots, P·R, 2] int32, see SlotWeights

    def set_slot(self, slot: int, weights: SlotWeights | None) -> None:
        """Copy ``weights`` into ``slot`` (None: the slot's adapter does not touch this
        projection, so its rows get a zero delta here)."""
        if weights is None:
            if self.a is not None and self.b is not None and self.cols is not None:
                self._grow(slot + 1, 0)
                self.a[slot].zero_()
                self.b[slot].zero_()
                self.cols[slot].zero_()
            return
        if self.a is None or self.b is None or self.cols is None:
            slots = max(slot + 1, self.step.num_slots)
            self.a = weights.a.new_zeros(slots, weights.rank, weights.a.shape[1])
            self.b = weights.b.new_zeros(slots, weights.rank, weights.b.shape[1])
            self.cols = weights.cols.new_zeros(slots, weights.rank, 2)
        self._grow(slot + 1, weights.rank)
        a, b, cols = self.a, self.b, self.cols
        assert a is not None and b is not None and cols is not None
        a[slot].zero_()
        b[slot].zero_()
        cols[slot].zero_()
        a[slot, : weights.rank].copy_(weights.a)
        b[slot, : weights.rank].copy_(weights.b)
        cols[slot, : weights.rank].copy_(weights.cols)

    def _grow(self, num_slots: int, rank: int) -> None:
        """Make the stacks hold at least ``num_slots`` slots (every slot the runner has
        used, so a step's slot indices are always in range) and ``rank`` rank rows."""
        assert self.a is not None and self.b is not None and self.cols is not None
        slots, have = self.a.shape[0], self.a.shape[1]
        num_slots = max(num_slots, self.step.num_slots)
        if num_slots <= slots and rank <= have:
            return
        new_slots, new_rank = max(slots, num_slots), max(have, rank)
        grown_a = self.a.new_zeros(new_slots, new_rank, self.a.shape[2])
        grown_b = self.b.new_zeros(new_slots, new_rank, self.b.shape[2])
        grown_cols = self.cols.new_zeros(new_slots, new_rank, 2)
        grown_a[:slots, :have].copy_(self.a)
        grown_b[:slots, :have].copy_(self.b)
        grown_cols[:slots, :have].copy_(self.cols)
        self.a, self.b, self.cols = grown_a, grown_b, grown_cols

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base output of ``x``) with each adapter row's delta added in place."""
        step = self.step
        if not step.active or self.a is None or self.b is None:
            return y
        if step.use_kernel:
            y = y if y.is_contiguous() else y.contiguous()
            torch.ops.genserve.lora_bgmv_(
                y, x.contiguous(), self.a, self.b, self.cols, step.row_slot
            )
            return y
        if step.batched:
            assert step.used is not None and step.pad_rows is not None
            num_used = step.used.shape[0]
            a = self.a if num_used == self.a.shape[0] else self.a.index_select(0, step.used)
            b = self.b if num_used == self.b.shape[0] else self.b.index_select(0, step.used)
            xs = x.index_select(0, step.pad_rows).view(num_used, step.seg_len, x.shape[1])
            shrunk = torch.bmm(xs, a.transpose(1, 2))  # [U, L, P·R]
            shrunk.mul_(step.mask(shrunk.dtype))  # padding rows: zero delta
            delta = torch.bmm(shrunk, b)  # [U, L, out]
            return y.index_add_(0, step.pad_rows, delta.view(-1, y.shape[1]))
        for slot, rows in step.segments:
            if slot >= self.a.shape[0]:
                continue
            xs = x.index_select(0, rows)
            delta = (xs @ self.a[slot].t()) @ self.b[slot]
            y.index_add_(0, rows, delta)
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
