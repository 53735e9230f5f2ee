"""Per-request state the runner keeps between steps, keyed by ``req_id``.

* :class:`RequestState` — what the sampler needs about a running request: its sampling
  parameters, how many tokens it has (prompt, output), its prompt when prompt logprobs are
  wanted, its LoRA slot.
* :class:`PenaltyCounts` — token occurrences of the requests that use penalties, one *slot*
  (row) each in a single device tensor ``[2, slots, vocab]`` float32: plane 0 counts prompt +
  output tokens (repetition and frequency penalties), plane 1 the output only (presence).
  A step's sampled tokens are added with one ``scatter_add_`` straight from the device's token
  ids, with no round trip through the host and no kernel per row (issue #29).  The table's
  last row is never handed out and stays zero: rows without penalties read it in a
  captured sampled step (worker/sampled_tail.py), whose graph holds the table, so a runner
  with graphs allocates its slots up front (``capacity``); growing past them reallocates
  the table (:attr:`PenaltyCounts.generation`) and penalised steps then sample eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.step import NewRequestData, SamplingParams
from genserve.worker.device_io import DeviceIO


@dataclass(slots=True)
class RequestState:
    sampling: SamplingParams
    num_prompt_tokens: int
    num_tokens: int  # prompt + output tokens known so far
    num_output_tokens: int
    prompt_token_ids: tuple[int, ...]  # kept only when prompt logprobs are wanted
    adapter_slot: int = -1  # LoRA slot, -1: the base model
    last_token: int = 0  # the last known token (a placeholder chunk's, on the host)

    @classmethod
    def from_new(cls, new: NewRequestData) -> RequestState:
        p = new.sampling
        return cls(
            sampling=p,
            num_prompt_tokens=new.num_prompt_tokens,
            num_tokens=len(new.all_token_ids),
            num_output_tokens=new.num_output_tokens,
            prompt_token_ids=new.all_token_ids[: new.num_prompt_tokens]
            if p.prompt_logprobs
            else (),
            adapter_slot=new.adapter.slot if new.adapter is not None else -1,
            last_token=new.all_token_ids[-1],
        )


class PenaltyCounts:
    """Occurrence counts of penalised requests, one slot each, grown by doubling."""

    def __init__(
        self, vocab_size: int, device: torch.device, io: DeviceIO, capacity: int = 0
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.io = io
        shape = (2, capacity + 1, vocab_size)  # + the zero row
        self.table = torch.zeros(shape, dtype=torch.float32, device=device)
        self._slots: dict[str, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self.generation = 0  # bumped when the table is reallocated (graphs compare it)

    @property
    def zero_slot(self) -> int:
        """The always-zero row: what a row without penalties reads."""
        return int(self.table.shape[1]) - 1

    def slot_or_zero(self, req_id: str) -> int:
        return self._slots.get(req_id, self.zero_slot)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slots

    def add(self, new: NewRequestData) -> None:
        """Give ``new`` a slot holding the counts of its tokens so far (a readmitted request
        brings its output too)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slots[new.req_id] = slot
        vocab = self.vocab_size
        ids = self.io.upload(new.all_token_ids, torch.int64)
        # Ids past the logits width (none after validation) count for nothing, as bincount's
        # [:vocab] did; index_add_ rather than bincount, which reads its maximum back on CUDA.
        weights = (ids < vocab).to(self.table.dtype)
        ids = ids.clamp(max=vocab - 1)
        counts, output = self.table[0, slot], self.table[1, slot]
        counts.zero_().index_add_(0, ids, weights)
        start = new.num_prompt_tokens
        output.zero_().index_add_(0, ids[start:], weights[start:])

    def remove(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def rows(self, req_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(prompt + output counts, output counts)`` of ``req_id``: ``[vocab]`` views."""
        slot = self._slots[req_id]
        return self.table[0, slot], self.table[1, slot]

    def record(self, req_ids: list[str], token_ids: torch.Tensor) -> None:
        """Count ``token_ids[i]`` (on the device) for ``req_ids[i]``: one ``scatter_add_``."""
        if not req_ids:
            return
        vocab = self.vocab_size
        plane = self.table.shape[1] * vocab
        # The same requests step after step: their slot offsets are uploaded once.
        bases = self.io.upload_cached("penalty_bases", [self._slots[r] * vocab for r in req_ids])
        base = bases + token_ids
        index = torch.cat((base, base + plane))
        ones = torch.ones(index.shape, dtype=self.table.dtype, device=self.device)
        self.table.view(-1).scatter_add_(0, index, ones)

    def _grow(self) -> None:
        old = self.zero_slot
        size = max(4, 2 * old)
        shape = (2, size + 1, self.vocab_size)
        table = torch.zeros(shape, dtype=torch.float32, device=self.device)
        table[:, :old] = self.table[:, :old]
        self.table = table
        self.generation += 1
        self._free.extend(range(size - 1, old - 1, -1))
