"""Which projections of a few-row CUDA step take the Triton matmul (``kernels/triton_gemv``)
instead of cuBLAS, decided by timing both on this GPU at load.

Every half-precision projection is grouped by what its kernel sees (``N``, ``K``, dtype,
bias, float32 output for the LM head).  For each group and each tile height (1, 2, 4 rows)
the plan times cuBLAS and the Triton tiles over all the group's weights in turn — each pass
captured as a CUDA graph, so launch costs on the host do not count (inside the decode step's
graphs they do not either), after a write over twice the L2 cache, so every weight comes from
memory as it does in a step that reads the whole model.  A tile replaces cuBLAS only where it
is at least :data:`MARGIN` faster; one row picks among every tile of
``triton_gemv.TILES``, two and four rows try only one row's winner (each tile a row count
is one more Triton compilation at start-up).

Nothing is tuned to one GPU: where cuBLAS is as fast, it stays, and the log line
``gpu_gemv_plan`` gives each group's times and choice.  ``GENSERVE_GPU_GEMV=off`` skips the
plan (cuBLAS everywhere: the A/B of docs/gpu-step.md), as the CPU kernels' crossovers have
their environment overrides.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import structlog
import torch
import torch.nn.functional as F

from genserve.kernels import triton_attention, triton_gemv
from genserve.kernels.triton_gemv import MAX_ROWS, TILES, GemvTile, padded_rows

log = structlog.get_logger("genserve.model")

# A tile must beat cuBLAS by this fraction to replace it (timing noise, and a kernel the
# device's library keeps tuning stays where it ties).
MARGIN = 0.03
_PASSES = 3  # timed replays of each pass; the fastest counts
_HEIGHTS = (1, 2, 4)  # the tile heights timed (padded_rows of 1..MAX_ROWS)


def enabled() -> bool:
    """Whether CUDA models plan their few-row matmuls (``GENSERVE_GPU_GEMV``: auto | off)."""
    return os.environ.get("GENSERVE_GPU_GEMV", "auto").strip().lower() not in ("off", "0")


@dataclasses.dataclass(frozen=True)
class GemvChoice:
    """A projection's Triton tile per row count (``tiles[rows - 1]``; None: cuBLAS)."""

    tiles: tuple[GemvTile | None, ...]
    out_float32: bool = False

    def tile_for(self, rows: int) -> GemvTile | None:
        return self.tiles[rows - 1] if 1 <= rows <= len(self.tiles) else None

    def run(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: GemvTile
    ) -> torch.Tensor:
        """One launch of ``tile``.  Launched directly, not as a torch custom op as the fused
        layer ops are: an eager few-row step (a LoRA decode step, a prompt of a few tokens)
        is host-bound, and there a fused op's custom-op call took 56-77 µs of host time
        against ~28 µs for cuBLAS's ``aten::mm`` (session 18's profile, an H100's host)."""
        out_dtype = torch.float32 if self.out_float32 else x.dtype
        if triton_attention.available(x.device):
            return triton_gemv.gemv(x, weight, bias, tile, out_dtype)
        return triton_gemv.reference(x, weight, bias, out_dtype)


class Projection(Protocol):
    """What the plan reads and sets on a layer (``model/layers._Packable``)."""

    weight: torch.Tensor
    gpu_gemv: GemvChoice | None


@dataclasses.dataclass(frozen=True)
class GroupKey:
    n: int
    k: int
    dtype: torch.dtype
    has_bias: bool
    out_float32: bool


# time_pass(key, rows, tile or None for cuBLAS, weights, biases) → ms per matmul
PassTimer = Callable[
    [GroupKey, int, GemvTile | None, Sequence[torch.Tensor], Sequence[torch.Tensor | None]], float
]


def plannable(weight: torch.Tensor) -> bool:
    """A plain half-precision matrix on CUDA (the kernel's case)."""
    return (
        weight.is_cuda
        and weight.dim() == 2
        and weight.dtype in (torch.bfloat16, torch.float16)
        and weight.numel() > 0
        and weight.stride(1) == 1
    )


def group(
    projections: Iterable[Projection], head: Projection | None
) -> dict[GroupKey, list[Projection]]:
    """The projections the kernel may take, by what their launches look like."""
    groups: dict[GroupKey, list[Projection]] = {}
    members = [(p, False) for p in projections] + ([(head, True)] if head is not None else [])
    for proj, is_head in members:
        w = proj.weight
        if not plannable(w):
            continue
        bias = None if is_head else getattr(proj, "bias", None)
        key = GroupKey(w.shape[0], w.shape[1], w.dtype, bias is not None, is_head)
        groups.setdefault(key, []).append(proj)
    return groups


def choose(
    groups: dict[GroupKey, list[Projection]], time_pass: PassTimer
) -> list[dict[str, object]]:
    """Time each group (``time_pass``), set each projection's ``gpu_gemv``; returns one
    record a group for the log."""
    records: list[dict[str, object]] = []
    for key, members in groups.items():
        weights = [m.weight for m in members]
        biases = [getattr(m, "bias", None) if not key.out_float32 else None for m in members]
        by_height: dict[int, GemvTile | None] = {}
        times: dict[str, float] = {}
        # Tiles no wider than K's power of two (the narrowest where K is shorter still).
        fits = [t for t in TILES if t.block_k <= _pow2_at_least(key.k)]
        candidates: Sequence[GemvTile] = fits or [min(TILES, key=lambda t: t.block_k)]
        for height in _HEIGHTS:
            base = time_pass(key, height, None, weights, biases)
            timed = {t: time_pass(key, height, t, weights, biases) for t in candidates}
            best = min(timed, key=lambda t: timed[t])
            times[f"rows{height}_cublas_us"] = round(base * 1e3, 2)
            times[f"rows{height}_best_us"] = round(timed[best] * 1e3, 2)
            by_height[height] = best if timed[best] < (1 - MARGIN) * base else None
            if height == 1:  # more rows: only the one-row winner (one compile each)
                candidates = [best]
        tiles = tuple(by_height[padded_rows(r)] for r in range(1, MAX_ROWS + 1))
        choice = GemvChoice(tiles, key.out_float32) if any(tiles) else None
        for m in members:
            m.gpu_gemv = choice
        records.append(
            {
                "shape": f"{key.n}x{key.k}",
                "dtype": str(key.dtype).removeprefix("torch."),
                "matrices": len(members),
                "head": key.out_float32,
                "tiles": [str(t) if t else "cublas" for t in tiles],
                **times,
            }
        )
    return records


def plan(projections: Iterable[Projection], head: Projection | None) -> list[dict[str, object]]:
    """Time and choose on the current CUDA device; logs ``gpu_gemv_plan``."""
    started = time.perf_counter()
    groups = group(projections, head)
    if not groups:
        return []
    device = next(iter(groups.values()))[0].weight.device
    try:
        with torch.no_grad():
            timer = GraphPassTimer(device)
            records = choose(groups, timer)
            timer.release()
    except Exception as exc:  # a failed compile (Triton's own errors) or capture: cuBLAS stays
        for members in groups.values():
            for m in members:
                m.gpu_gemv = None
        log.warning("gpu_gemv_plan_failed", error=str(exc)[:500], detail="cuBLAS for every step")
        return []
    log.info("gpu_gemv_plan", groups=records, seconds=round(time.perf_counter() - started, 2))
    return records


class GraphPassTimer:
    """Times one pass over a group's weights, captured as a CUDA graph and replayed after a
    write over twice the L2 cache (:data:`_PASSES` replays, the fastest)."""

    def __init__(self, device: torch.device) -> None:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
        self._flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def __call__(
        self,
        key: GroupKey,
        rows: int,
        tile: GemvTile | None,
        weights: Sequence[torch.Tensor],
        biases: Sequence[torch.Tensor | None],
    ) -> float:
        device = weights[0].device
        x = torch.randn(rows, key.k, dtype=key.dtype, device=device)
        choice = GemvChoice((tile,) * MAX_ROWS, key.out_float32)

        def one(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            if tile is not None:
                return choice.run(x, w, b, tile)
            if key.out_float32:  # the head's cuBLAS call (layers.ParallelLMHead)
                try:
                    return torch.mm(x, w.t(), out_dtype=torch.float32)
                except (RuntimeError, TypeError):  # a torch without mm(out_dtype=)
                    return F.linear(x.float(), w.float())
            return F.linear(x, w, b)

        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            one(weights[0], biases[0])  # compiles a Triton tile before capture
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a pool of its own, freed with the graph
            for w, b in zip(weights, biases, strict=True):
                one(w, b)
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        best = float("inf")
        for _ in range(_PASSES):
            self._flush.zero_()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / len(weights))
        del graph
        return best

    def release(self) -> None:
        del self._flush
        torch.cuda.empty_cache()


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
