"""Checkpoint tensors seen under the names and layouts the decoder's parts load.

Families store some parts differently from the separate ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` matrices the fused projections load: Phi-3 fuses ``[q | k | v]``
and ``[gate | up]`` rows into one matrix, GPT-NeoX interleaves them per head, and partial or
interleaved rotary permutes each head's q/k features (``rotary.head_permutation``).
:class:`RowViews` presents such tensors as the virtual separate ones, as rows gathered from
the real tensor (only the rows asked for, so tensor-parallel shards still read their part).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.model.weights import WeightSource


@dataclass(frozen=True, slots=True)
class RowView:
    """Virtual tensor = rows ``rows`` of ``source`` (all of them: None), optionally with its
    last dimension permuted by ``columns`` (a per-head norm weight)."""

    source: str
    rows: torch.Tensor | None = None
    columns: torch.Tensor | None = None


class RowViews:
    """A :class:`WeightSource` that resolves names in ``views`` through them, every other
    name through ``base``."""

    def __init__(self, base: WeightSource, views: dict[str, RowView]) -> None:
        self.base = base
        self.views = views

    def has(self, name: str) -> bool:
        return name in self.views or self.base.has(name)

    def shape(self, name: str) -> tuple[int, ...]:
        view = self.views.get(name)
        if view is None:
            return self.base.shape(name)
        shape = list(self.base.shape(view.source))
        if view.rows is not None:
            shape[0] = view.rows.numel()
        return tuple(shape)

    def get(self, name: str) -> torch.Tensor:
        view = self.views.get(name)
        if view is None:
            return self.base.get(name)
        tensor = self.base.get(view.source)
        if view.rows is not None:
            tensor = tensor.index_select(0, view.rows)
        if view.columns is not None:
            tensor = tensor.index_select(-1, view.columns)
        return tensor

    def get_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        view = self.views.get(name)
        if view is None:
            return self.base.get_slice(name, dim, start, stop)
        if dim == 0 and view.columns is None:
            rows = view.rows
            if rows is None:
                return self.base.get_slice(view.source, 0, start, stop)
            wanted = rows[start:stop]
            lo, hi = int(wanted.min()), int(wanted.max()) + 1
            # Read the smallest row range holding the wanted rows, then gather them.
            block = self.base.get_slice(view.source, 0, lo, hi)
            return block.index_select(0, wanted - lo)
        return self.get(name).narrow(dim, start, stop - start)


def head_rows(
    num_heads: int, head_dim: int, perm: list[int] | None, offset: int = 0
) -> torch.Tensor:
    """Row indices of ``num_heads`` consecutive heads starting at row ``offset``, each head's
    features reordered by ``perm``."""
    inner = torch.arange(head_dim) if perm is None else torch.tensor(perm)
    heads = torch.arange(num_heads)[:, None] * head_dim
    return (offset + heads + inner[None, :]).reshape(-1)
