"""Token rows of a quantized embedding table, kept dequantized after their first lookup.

A model whose embedding is tied to a quantized head (a GGUF file's ``token_embd``) keeps the
table only as the head's packed blocks, and every step dequantizes the rows it looks up.  At
one stream that is one row, but a dozen small torch ops (panel and column indices, gathers,
widening, scaling): ~60-70 us of a 135M Q8_0 step of ~6 ms on a 2-vCPU Zen 4 (py-spy over the
runner), all of it host time while the OpenMP workers wait.  A row's dequantized values depend
on nothing but the table and the token id, so one computed once is the same tensor every later
time: the cache gives bit-identical rows.  Bounded by bytes (a few thousand rows of a small
model, a few hundred of an 8B's), filled first come first kept; single-row lookups on the CPU
only (a batch dequantizes its rows in one pass as before, and another device would have to
read the id back to the host).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# 4 MiB: 1,820 rows of SmolLM2-135M's 576 float32 features, 256 of a 4096-wide 8B's.
DEFAULT_BUDGET_BYTES = 4 << 20


class DequantizedRowCache:
    """Dequantized single rows of one table, by token id; forgets them when the table or the
    dtype changes (a re-packed or re-placed table is a new object)."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self._budget = budget_bytes
        self._rows: dict[int, torch.Tensor] = {}
        self._table: object = None
        self._dtype: torch.dtype | None = None

    def lookup(
        self,
        table: object,
        ids: torch.Tensor,
        dtype: torch.dtype,
        dequantize: Callable[[torch.Tensor, torch.dtype], torch.Tensor],
    ) -> torch.Tensor:
        """``dequantize(ids, dtype)`` (``[len(ids), hidden]``), from the cache where it can be:
        a fresh tensor either way (callers may write into what they get)."""
        if ids.numel() != 1 or ids.device.type != "cpu":
            return dequantize(ids, dtype)
        if table is not self._table or dtype != self._dtype:
            self._rows.clear()
            self._table, self._dtype = table, dtype
        token = int(ids.reshape(()).item())
        row = self._rows.get(token)
        if row is None:
            row = dequantize(ids, dtype)
            if (len(self._rows) + 1) * row.numel() * row.element_size() > self._budget:
                return row
            self._rows[token] = row
        return row.clone()

    def __len__(self) -> int:
        return len(self._rows)
