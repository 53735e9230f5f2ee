"""Tensor-parallel context: which rank this process is, how many there are, and collectives.

Model layers take a :class:`ParallelContext` and ask it for their shard of a dimension and for
the collectives that join shards (all-reduce after row-parallel layers, all-gather of
vocab-parallel logits).  At world size 1 every collective is the identity and no
``torch.distributed`` call is made, so the single-process path has no distributed overhead and
needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """This process's place in the tensor-parallel group.

    ``group`` is the process group the collectives run on (``None``: the default group once
    ``torch.distributed`` is initialised; unused at world size 1).  ``expert_parallel``
    (``--expert-parallel``): mixture-of-experts layers give each rank whole routed experts
    (:meth:`expert_share`) instead of a slice of every expert's width.
    """

    rank: int = 0
    world_size: int = 1
    group: ProcessGroup | None = None
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"bad tensor-parallel rank {self.rank} of {self.world_size}")

    @classmethod
    def single(cls) -> ParallelContext:
        """One process holding the whole model."""
        return cls()

    @property
    def is_driver(self) -> bool:
        """Rank 0 samples and talks to the scheduler."""
        return self.rank == 0

    def shard(self, size: int, what: str = "dimension") -> tuple[int, int]:
        """``[start, stop)`` of this rank's equal share of ``size``; raises when uneven."""
        if size % self.world_size:
            raise ValueError(
                f"{what} of size {size} cannot be split evenly across {self.world_size} shards"
            )
        per_rank = size // self.world_size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def balanced_shard(self, size: int) -> tuple[int, int]:
        """``[start, stop)`` of this rank's contiguous share of ``size`` units split as evenly
        as possible: the first ``size % world_size`` ranks own one more (e.g. 9 attention
        heads on 2 shards: 5 and 4)."""
        per_rank, extra = divmod(size, self.world_size)
        start = self.rank * per_rank + min(self.rank, extra)
        return start, start + per_rank + (1 if self.rank < extra else 0)

    def expert_share(self, num_experts: int) -> tuple[int, int]:
        """``[start, stop)`` of the routed experts this rank holds under expert parallelism:
        a contiguous, as-even-as-possible share (8 experts on 3 shards: 3, 3, 2), so any
        expert count splits.  Raises when some rank would hold none."""
        if num_experts < self.world_size:
            raise ValueError(
                f"--expert-parallel: {num_experts} routed experts cannot be shared by "
                f"{self.world_size} shards (each shard needs at least one)"
            )
        return self.balanced_shard(num_experts)

    def padded_shard(self, size: int) -> tuple[int, int, int]:
        """``(start, stop, per_rank)`` where every rank owns ``per_rank = ceil(size / world)``
        rows, the last ones possibly fewer real rows than ``per_rank`` (vocab padding)."""
        per_rank = -(-size // self.world_size)
        start = min(self.rank * per_rank, size)
        return start, min(start + per_rank, size), per_rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` across ranks, in place; returns it."""
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on all ranks) along ``dim``."""
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
