"""Per-request sampling parameters kept on the device across steps (issue #29).

vLLM's ``InputBatch`` idea: every request the runner knows holds a *slot* in a few device
tensors (temperature, top-k, top-p, min-p, typical-p, the four penalties, its seed, its
prompt length and its output count).  A slot is written once, with one small upload, when
its request is registered; a step then only gathers the rows it samples with an index
tensor, which is itself reused while the batch stays the same.  So a steady decode batch
uploads no sampling parameter at all: nothing is rebuilt from Python lists per step.

The uniform draw of a seeded row (:func:`genserve.worker.sampler.row_uniform`, a splitmix64
hash of ``(seed, output_index)``) is computed on the device from the slot's seed and output
count, bit for bit what the host computes: int64 arithmetic wraps like the host's
``& (2**64 - 1)`` and logical shifts are arithmetic shifts masked.  The output counts advance
on the device by one per sampled row that reads them (:func:`uses_output_count`: an
all-greedy step launches nothing for it); a speculative chunk (several tokens, or fewer
than drafted, kept) writes its slot's count from the host.

A slot also holds its request's logit bias (up to :data:`BIAS_WIDTH` ids and values) and
its ``min_new_tokens`` banned ids (up to :data:`BAN_WIDTH`), padded with id -1, so the
sampled tail captured in a CUDA graph (worker/sampled_tail.py) reads them with fixed shapes.
The eager sampler still uploads them per step (worker/logits_processors.py); the watermark
is never here.

The table's tensors are what a captured graph reads: they must not be reallocated while a
graph holds them.  ``capacity`` sets the slots allocated up front (a runner with graphs asks
for many; the tensors are small); past it the table grows by doubling and the graphs see
that their sources changed (:attr:`SamplingTable.generation`) and sample eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from genserve.step import SamplingParams
from genserve.worker.device_io import DeviceIO

# float32 columns, in the order of the table's rows.
FLOAT_COLUMNS = (
    "temperature",
    "top_p",
    "min_p",
    "typical_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "output_frequency_penalty",
)
# int64 columns: top_k, the seed (as two's-complement int64), prompt length, output count,
# min_new_tokens.
_TOP_K, _SEED, _NUM_PROMPT, _NUM_OUTPUT, _MIN_NEW = range(5)
_NUM_INTS = 5
# Per-slot logit-bias entries and min_new_tokens banned ids kept on the device; a request
# with more runs its steps through the eager sampler (worker/sampled_tail.graphable).
BIAS_WIDTH = 32
BAN_WIDTH = 16
# The neutral slot (default parameters) padding rows of a captured step read.
PADDING_REQ = "\x00padding"

_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    """``value`` mod 2**64 as a two's-complement int64 (a tensor's bits)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def device_uniform(seed: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """:func:`~genserve.worker.sampler.row_uniform` of int64 tensors, as float64 ``[n]``."""
    x = seed * _GOLDEN + output_index + 1
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = _shift_right(x ^ _shift_right(x, 31), 1)  # row_seed: 63 bits
    return (x >> 10).to(torch.float64) * 2.0**-53


@dataclass(frozen=True, slots=True)
class TableRows:
    """The slots of a step's sampling rows (``[rows]`` int64 on the device) and, for rows
    of speculative chunks, their offset past the slot's output count (None: all 0)."""

    table: SamplingTable
    slots: torch.Tensor
    offsets: torch.Tensor | None = None

    def subset(self, index: torch.Tensor) -> TableRows:
        """The rows ``index`` (a device index tensor) of these."""
        offsets = self.offsets.index_select(0, index) if self.offsets is not None else None
        return TableRows(self.table, self.slots.index_select(0, index), offsets)

    def column(self, name: str) -> torch.Tensor:
        """float32 ``[rows]`` values of parameter ``name`` (one of :data:`FLOAT_COLUMNS`)."""
        return self.table.floats[FLOAT_COLUMNS.index(name)].index_select(0, self.slots)

    def top_k(self) -> torch.Tensor:
        return self.table.ints[_TOP_K].index_select(0, self.slots)

    def output_index(self) -> torch.Tensor:
        """int64 ``[rows]``: the output token number each row samples."""
        index = self.table.ints[_NUM_OUTPUT].index_select(0, self.slots)
        return index if self.offsets is None else index + self.offsets

    def num_tokens(self) -> torch.Tensor:
        """int64 ``[rows]``: prompt + output tokens before each row's token."""
        return self.table.ints[_NUM_PROMPT].index_select(0, self.slots) + self.output_index()

    def uniform(self) -> torch.Tensor:
        """float64 ``[rows]``: each row's uniform draw, computed on the device."""
        seed = self.table.ints[_SEED].index_select(0, self.slots)
        return device_uniform(seed, self.output_index())


def uses_output_count(params: SamplingParams) -> bool:
    """Whether a row's slot output count is read: for its seeded draw, for TGI's
    frequency penalty (normalised by the sequence length), or for its ``min_new_tokens``
    ban (read by the sampled tail).  Other rows' counts may lag."""
    return not params.greedy or params.frequency_penalty != 0.0 or params.min_new_tokens > 0


class SamplingTable:
    """Slots of per-request sampling parameters on one device, grown by doubling."""

    def __init__(self, device: torch.device, io: DeviceIO, capacity: int = 8) -> None:
        self.device = device
        self.io = io
        self.floats = torch.zeros((len(FLOAT_COLUMNS), capacity), device=device)
        self.ints = torch.zeros((_NUM_INTS, capacity), dtype=torch.int64, device=device)
        # [slots, BIAS_WIDTH] ids (-1: unused) and values; [slots, BAN_WIDTH] banned ids.
        self.bias_ids = torch.full((capacity, BIAS_WIDTH), -1, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros((capacity, BIAS_WIDTH), device=device)
        self.ban_ids = torch.full((capacity, BAN_WIDTH), -1, dtype=torch.int64, device=device)
        self._slots: dict[str, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self.num_slot_writes = 0  # uploads of slot values (the counting test reads it)
        self.generation = 0  # bumped when the tensors are reallocated (graphs compare it)

    def slot(self, req_id: str) -> int:
        return self._slots[req_id]

    def padding_slot(self) -> int:
        """A slot of default parameters (greedy, no filter) for padding rows, made once."""
        if PADDING_REQ not in self._slots:
            self.add(PADDING_REQ, SamplingParams(), 0, 0)
        return self._slots[PADDING_REQ]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slots

    def add(self, req_id: str, params: SamplingParams, num_prompt: int, num_output: int) -> None:
        """Give ``req_id`` a slot holding its parameters (a readmitted request keeps its
        output count): one upload of each column kind."""
        slot = self._slots.get(req_id)
        if slot is None:
            if not self._free:
                self._grow()
            slot = self._slots[req_id] = self._free.pop()
        # Ids past the widths are not stored: such a request never samples in a graph.
        bias = list(params.logit_bias[:BIAS_WIDTH])
        bias += [(-1, 0.0)] * (BIAS_WIDTH - len(bias))
        bans = list(params.min_tokens_banned_ids[:BAN_WIDTH])
        bans += [-1] * (BAN_WIDTH - len(bans))
        floats = [float(getattr(params, name)) for name in FLOAT_COLUMNS]
        floats += [value for _, value in bias]
        ints = [params.top_k, _signed64(params.seed), num_prompt, num_output]
        ints += [params.min_new_tokens] + [i for i, _ in bias] + bans
        # One upload of each kind, then device copies into the slot's places.
        f = self.io.upload(floats, torch.float32)
        n = len(FLOAT_COLUMNS)
        self.floats[:, slot].copy_(f[:n])
        self.bias_values[slot].copy_(f[n:])
        i = self.io.upload(ints, torch.int64)
        self.ints[:, slot].copy_(i[:_NUM_INTS])
        self.bias_ids[slot].copy_(i[_NUM_INTS : _NUM_INTS + BIAS_WIDTH])
        self.ban_ids[slot].copy_(i[_NUM_INTS + BIAS_WIDTH :])
        self.num_slot_writes += 1

    def remove(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def rows(self, req_ids: Sequence[str], offsets: Sequence[int] | None = None) -> TableRows:
        """The slots of sampling rows belonging to ``req_ids`` (one per row), through an
        index tensor reused while the rows stay the same; ``offsets`` (rows of speculative
        chunks: 0, 1, ...) are uploaded only when given."""
        slots = self.io.upload_cached("sampling_slots", [self._slots[r] for r in req_ids])
        offset_tensor = self.io.upload(offsets, torch.int64) if offsets is not None else None
        return TableRows(self, slots, offset_tensor)

    def advance(self, rows: TableRows) -> None:
        """One more output token for every row's slot (each slot at most once in ``rows``:
        steps without speculative chunks), on the device."""
        counts = self.ints[_NUM_OUTPUT]
        counts.index_add_(0, rows.slots, torch.ones_like(rows.slots))

    def set_output_counts(self, req_ids: Sequence[str], counts: Sequence[int]) -> None:
        """Write the output counts of ``req_ids`` from the host (after speculative chunks)."""
        if not req_ids:
            return
        index = self.io.upload([self._slots[r] for r in req_ids], torch.int64)
        self.ints[_NUM_OUTPUT].index_copy_(0, index, self.io.upload(counts, torch.int64))
        self.num_slot_writes += 1

    def _grow(self) -> None:
        old = self.floats.shape[1]
        size = 2 * old
        floats = torch.zeros((len(FLOAT_COLUMNS), size), device=self.device)
        ints = torch.zeros((_NUM_INTS, size), dtype=torch.int64, device=self.device)
        bias_ids = torch.full((size, BIAS_WIDTH), -1, dtype=torch.int64, device=self.device)
        bias_values = torch.zeros((size, BIAS_WIDTH), device=self.device)
        ban_ids = torch.full((size, BAN_WIDTH), -1, dtype=torch.int64, device=self.device)
        floats[:, :old] = self.floats
        ints[:, :old] = self.ints
        bias_ids[:old] = self.bias_ids
        bias_values[:old] = self.bias_values
        ban_ids[:old] = self.ban_ids
        self.floats, self.ints = floats, ints
        self.bias_ids, self.bias_values, self.ban_ids = bias_ids, bias_values, ban_ids
        self.generation += 1
        self._free.extend(range(size - 1, old - 1, -1))
