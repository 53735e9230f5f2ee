"""The runner's side of CUDA graphs (#12): whether graphs apply, how much memory they need
before the KV cache is sized, capturing them after warm-up, and routing a step to them.

Kept out of ``model_runner.py`` so the runner only has one-line hooks; the graph machinery
itself is in :mod:`genserve.worker.cuda_graphs`.  The runner describes itself with a
:class:`GraphTarget` (its model and shapes) instead of this module importing the runner, so
the two do not depend on each other.  Any failure while planning or capturing is
logged as a warning and the runner stays eager: graphs are an optimisation, never a reason
not to serve.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
import torch

from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.attention_backend import select_backend
from genserve.worker.cuda_graphs import (
    DecodeGraphs,
    measure_capture_bytes,
    pad_decode_batch,
    pick_bucket,
)
from genserve.worker.device_io import DeviceIO, Readback
from genserve.worker.request_state import PenaltyCounts
from genserve.worker.sampled_tail import graphable, packed_width
from genserve.worker.sampler import PendingSamples, SamplerOutput, SamplingRow, unpack
from genserve.worker.sampling_table import SamplingTable

if TYPE_CHECKING:
    from genserve.step import ScheduledChunk

log = structlog.get_logger("genserve.worker")

# Measured graph memory is reserved with this margin (allocator rounding between the trial
# capture and the real one).
_RESERVE_MARGIN = 1.25
# Slots allocated up front where graphs sample (the graphs hold these tensors; past them the
# tables grow and those steps sample eagerly): sampling parameters are ~200 bytes a slot,
# penalty counts 8 bytes a vocabulary entry a slot (64 MiB for Llama-3's vocabulary).
GRAPH_TABLE_SLOTS = 1024
GRAPH_PENALTY_SLOTS = 64


def sampling_state(
    vocab_size: int, device: torch.device, io: DeviceIO, graphs: bool
) -> tuple[SamplingTable, PenaltyCounts]:
    """A runner's fresh per-slot sampling state: slots allocated up front when ``graphs``
    will read it (a captured sampled tail holds its tensors), grown on demand otherwise."""
    if not graphs:
        return SamplingTable(device, io), PenaltyCounts(vocab_size, device, io)
    return (
        SamplingTable(device, io, capacity=GRAPH_TABLE_SLOTS),
        PenaltyCounts(vocab_size, device, io, capacity=GRAPH_PENALTY_SLOTS),
    )


@dataclass(frozen=True, slots=True)
class GraphTarget:
    """What planning needs to know about the runner: its model (``forward(token_ids,
    positions, kv_caches, meta)`` → hidden states) and the shapes of its KV cache."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    world_size: int


@dataclass(frozen=True, slots=True)
class GraphPlan:
    sizes: tuple[int, ...]
    width: int  # block-table columns: blocks of the longest request
    reserve_bytes: int  # kept out of the KV-cache budget

    def capture(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        device: torch.device,
        lora_attached: bool,
        sampling: tuple[SamplingTable, PenaltyCounts] | None = None,
    ) -> DecodeGraphs | None:
        """Capture over the runner's (freshly zeroed) cache; None, with a warning, on failure.
        ``sampling``: the runner's per-slot sampling state, read by the sampled tails."""
        if lora_attached:
            log.warning("cuda_graphs_disabled", reason="LoRA hooks attached before capture")
            return None
        try:
            graphs = _build(model, kv_caches, self, device, sampling)
            graphs.capture()
        except Exception as exc:  # any capture failure means "stay eager"
            log.warning("cuda_graphs_capture_failed", error=repr(exc), fallback="eager")
            torch.cuda.empty_cache()
            return None
        log.info(
            "cuda_graphs_captured",
            batch_sizes=list(graphs.captured_sizes),
            seconds=round(graphs.capture_seconds, 2),
            reserved_bytes=self.reserve_bytes,
        )
        return graphs


def _build(
    model: Any,
    kv_caches: list[torch.Tensor],
    plan: GraphPlan,
    device: torch.device,
    sampling: tuple[SamplingTable, PenaltyCounts] | None = None,
) -> DecodeGraphs:
    """The graphs over ``kv_caches``, sampling from ``sampling`` (None: a throw-away state
    of the same size, for the trial capture)."""
    block_dim = 2  # TorchPagedAttention's cache: [2, kv_heads, num_blocks, block_size, hd]
    num_blocks = kv_caches[0].shape[block_dim]
    if sampling is None:
        sampling = sampling_state(int(model.config.vocab_size), device, DeviceIO(device), True)
    graphs = DecodeGraphs(
        model,
        kv_caches,
        plan.sizes,
        plan.width,
        kv_caches[0].shape[3],
        scratch_block=num_blocks - 1,
        device=device,
        use_triton_decode=True,
    )
    graphs.bind_sampling(*sampling)
    return graphs


def plan_graphs(
    target: GraphTarget, sizes: Sequence[int], max_seq_len: int, block_size: int
) -> GraphPlan | None:
    """A plan when graphs can run (CUDA, single process, the Triton decode kernel), with the
    memory they take measured by a trial capture on a throw-away cache; else None (logged).

    ``max_seq_len``: the longest context a request may reach (the derived total-token
    limit, not the model's position limit) — the block table's width.  The trial captures
    the largest bucket only: every bucket shares its memory pool, whose size the largest
    sets, so each bucket is captured once more at start-up, not twice."""
    if not sizes:
        return None
    if target.device.type != "cuda":
        log.info("cuda_graphs_ignored", reason="not on CUDA")
        return None
    if target.world_size > 1:
        log.warning("cuda_graphs_disabled", reason="tensor parallelism is not captured yet")
        return None
    backend = select_backend(target.device, block_size, target.dtype, target.head_dim)
    if not (isinstance(backend, TorchPagedAttention) and backend.use_triton_decode):
        log.warning(
            "cuda_graphs_disabled",
            reason=f"attention backend {backend.name} cannot be captured (needs triton-decode)",
        )
        return None
    width = -(-max_seq_len // block_size)
    plan = GraphPlan(tuple(sorted(sizes)), width, 0)
    trial = GraphPlan(plan.sizes[-1:], width, 0)
    try:
        shape = backend.kv_cache_shape(width + 1, block_size, target.num_kv_heads, target.head_dim)
        trial_cache = list(
            torch.zeros((target.num_layers, *shape), dtype=target.dtype, device=target.device)
        )
        with torch.inference_mode():
            used = measure_capture_bytes(
                lambda: _build(target.model, trial_cache, trial, target.device), target.device
            )
        trial_cache.clear()  # free the throw-away cache before the real one is sized
        torch.cuda.empty_cache()
    except Exception as exc:  # a failed trial means "stay eager"
        log.warning("cuda_graphs_capture_failed", error=repr(exc), fallback="eager")
        torch.cuda.empty_cache()
        return None
    log.info("cuda_graphs_planned", batch_sizes=list(plan.sizes), measured_bytes=used)
    return GraphPlan(plan.sizes, width, int(used * _RESERVE_MARGIN))


def graph_forward(
    graphs: DecodeGraphs,
    has_lora_rows: bool,
    chunks: Sequence[ScheduledChunk],
    seqs: Sequence[SeqSpec],
    sampling: tuple[SamplingTable, PenaltyCounts] | None = None,
    constrained: Sequence[str] = (),
    token_ids: Sequence[int] | None = None,
    fill: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor | None:
    """Hidden states of a pure-decode step (``seqs``: one decode row per token of
    ``chunks``) from a graph, or None when it must run eagerly (LoRA rows, no bucket, a
    context wider than the table).  ``sampling``: the runner's per-slot state, whose slots
    for each row are staged with the inputs (steps without draft tokens), with a flag on
    the rows of the ``constrained`` requests (the step's grammar mask applies to them).
    ``token_ids``: the rows' tokens, where they differ from the chunks' (placeholders);
    ``fill``: writes the placeholder rows of the graph's device token input, after the
    step's input copy and before the replay (``DecodeGraphs.run``)."""
    if has_lora_rows:
        return None
    bucket = pick_bucket(len(seqs), graphs.sizes)
    if bucket is None:
        return None
    if token_ids is None:
        token_ids = [t for c in chunks for t in c.token_ids]
    padded = pad_decode_batch(
        token_ids,
        [s.start_pos for s in seqs],
        [s.block_ids for s in seqs],
        bucket,
        graphs.width,
        graphs.block_size,
        graphs.scratch_block,
    )
    if padded is None:
        return None
    if sampling is None or any(c.num_draft_tokens for c in chunks):
        return graphs.run(padded, fill=fill)
    table, penalties = sampling
    masked = set(constrained)
    return graphs.run(
        padded,
        [table.slot(c.req_id) for c in chunks],
        [penalties.slot_or_zero(c.req_id) for c in chunks],
        [i for i, c in enumerate(chunks) if c.req_id in masked],
        fill,
    )


def plain_greedy(row: SamplingRow) -> bool:
    """Whether the sampler would take ``row``'s token as the argmax of the model's own
    logits and report nothing but its logprob: greedy, no penalty, logit bias, active
    ``min_new_tokens`` ban, watermark or top-n alternatives (grammar masks are the step's,
    checked by the caller)."""
    p = row.params
    return (
        p.greedy
        and not p.uses_penalties
        and not p.logit_bias
        and not (row.output_index < p.min_new_tokens and p.min_tokens_banned_ids)
        and not p.watermark
        and p.num_top_tokens == 0
    )


def graph_greedy(
    graphs: DecodeGraphs, rows: Sequence[SamplingRow], readback: Readback
) -> PendingSamples | None:
    """The tokens of a graph-replayed step whose rows (its first ``len(rows)`` rows) are all
    :func:`plain_greedy`, from the greedy tail graph and one readback, queued (what the
    sampler would return, bit for bit: the same ops); None when a row needs the sampler.
    The device ids are the tail block's first column (float32, exact below 2**24), valid
    until the next step's tail replays."""
    if not rows or not all(plain_greedy(r) for r in rows):
        return None
    packed = graphs.greedy(len(rows))
    return PendingSamples(readback.start(packed), _greedy_output, packed[:, 0])


def _greedy_output(host: list[list[float]]) -> SamplerOutput:
    return SamplerOutput([int(r[0]) for r in host], [r[1] for r in host], [()] * len(host))


def graph_sample(
    graphs: DecodeGraphs,
    rows: Sequence[SamplingRow],
    chunks: Sequence[ScheduledChunk],
    sampling: tuple[SamplingTable, PenaltyCounts],
    readback: Readback,
    grammar: tuple[torch.Tensor, Sequence[int]] | None = None,
) -> PendingSamples | None:
    """The tokens of a graph-replayed step (rows = its first ``len(rows)`` rows, one per
    chunk) from the bucket's sampled tail and one readback: what the sync-free sampler
    returns for them, with the slots' output and penalty counts already advanced on the
    device, and the readback queued (device ids: the block's first column, as
    :func:`graph_greedy`'s).  ``grammar``: the step's bitmask and the row of each of its
    rows (the rows :func:`graph_forward` flagged).  None when the step needs the eager
    sampler (draft tokens, a row the tail does not sample, state reallocated since
    capture, a bitmask it cannot stage)."""
    if not rows or any(c.num_draft_tokens for c in chunks) or not all(map(graphable, rows)):
        return None
    table, penalties = sampling
    penalised = any(c.req_id in penalties for c in chunks)
    if not graphs.can_sample(table, penalties, penalised):
        return None
    if grammar is not None and not graphs.stage_grammar(*grammar):
        return None
    packed = graphs.sampled(len(rows), table, penalties, penalised)
    assert packed is not None
    width = (packed_width(graphs.logits_buffer.shape[-1]) - 2) // 2
    params = [r.params for r in rows]
    return PendingSamples(
        readback.start(packed), lambda host: unpack(host, params, width), packed[:, 0]
    )
