"""CUDA graphs for decode steps: the model's forward over a padded decode batch, captured once
per batch-size bucket at start-up and replayed, so a step costs a few launches instead of
hundreds of Python-issued ones (issue #12: the runner's step time was flat from batch 1 to 64,
i.e. launch-bound).

How (the same shape as TGI's ``cuda_graph_warmup``, vLLM's CUDAGraphRunner and SGLang's
``cuda_graph_runner``):

- Static input buffers sized for the largest bucket: token ids, positions, slot mapping, block
  table ``[max_bucket, max_blocks_per_seq]``, context lengths.  A step copies its rows into
  them and replays the smallest bucket that holds its rows; padding rows decode token 0 at
  position 0 into a *scratch block* — one KV block allocated past the scheduler's blocks and
  never handed out — so padding never writes into a real sequence's cache.
- The block table always has ``max_blocks_per_seq`` columns (the longest request's blocks); the
  Triton decode kernel walks only the blocks a row's context length covers, so the width costs
  nothing at run time.  Graphs therefore need that kernel (``torch-sdpa+triton-decode``): the
  SDPA fallback gathers the whole padded width every step, and flash-attn takes its maximum
  context length as a host integer, which a graph would freeze.
- Every bucket shares one memory pool, captured largest first so smaller ones reuse it.
- What is replayed: ``model.forward`` (embeddings → last layer), then the final norm and the
  LM head into a static float32 logits buffer ``[largest bucket, vocab]`` (issue #29: they
  ran eagerly after the replay), one graph per bucket.  A second graph per bucket, the
  *greedy tail*, takes each row's argmax and its log-probability (the sampler's greedy ops,
  so the same values) into a static ``[largest bucket, 2]`` block: a step whose rows are all
  plain greedy replays both and reads that block back, nothing else running after the
  replay but the one copy.  A third graph per bucket, the *sampled tail*
  (worker/sampled_tail.py), samples every kind of row the eager sampler does except the
  watermark (penalties, logit bias, bans, grammar masks, temperature, top-k/p, min-p,
  typical-p, seeds, top-n) from per-slot parameter tensors that persist across steps; the
  rows' slots and grammar flags travel in three more rows of the step's one input copy, a
  constrained step's bitmask in one more copy.  Steps it cannot serve
  sample eagerly from the static logits.  Pure-decode steps replay (speculative chunks too:
  each draft token is a decode row); steps with a prefill chunk, with LoRA rows (the
  adapter hooks index per-step row tensors that the graph would freeze), or with a context
  longer than the table run eagerly.

The pure functions (bucket lists, padding) run anywhere and are unit-tested on CPU;
:class:`DecodeGraphs` with ``capture=False`` runs the same static-buffer forward eagerly, which
is how CPU tests check the padding and scratch-block logic against the ordinary path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from genserve.config import parse_batch_sizes as parse_batch_sizes  # the flag's parser
from genserve.model.attention import TorchAttentionMetadata
from genserve.worker.device_io import host_buffer
from genserve.worker.request_state import PenaltyCounts
from genserve.worker.sampled_tail import TailSources, grammar_words, packed_width, sample_tail
from genserve.worker.sampling_table import SamplingTable

log = structlog.get_logger("genserve.worker")

# Default buckets: every power of two up to 8, then steps of 8 (what TGI and vLLM default to);
# a step pads to the next bucket, so at most 7 wasted rows above 8.
_DEFAULT_MAX_BATCH = 256
# Token ids, positions, KV slots, context lengths; sampling slots, penalty slots, grammar
# flags (the sampled tail's).
_INPUT_ROWS = 7


def default_batch_sizes(max_batch: int | None) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to ``max_batch`` (256 when unknown)."""
    limit = max(1, min(max_batch or _DEFAULT_MAX_BATCH, _DEFAULT_MAX_BATCH))
    sizes = [s for s in (1, 2, 4, 8) if s <= limit]
    sizes += list(range(16, limit + 1, 8))
    if sizes[-1] < limit:
        # The bucket that holds the largest batch.
        sizes.append(1 << (limit - 1).bit_length() if limit < 8 else -(-limit // 8) * 8)
    return tuple(sizes)


def pick_bucket(num_rows: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding ``num_rows`` rows, or None (run eagerly)."""
    if num_rows < 1:
        return None
    for size in sizes:  # sorted ascending
        if size >= num_rows:
            return size
    return None


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """One decode step's inputs padded to ``bucket`` rows (numpy, copied into the buffers)."""

    num_rows: int
    bucket: int
    token_ids: np.ndarray  # [bucket] int64
    positions: np.ndarray  # [bucket] int64
    slots: np.ndarray  # [bucket] int64
    # [bucket, columns] int64: only the columns this step's longest context covers (at most
    # the buffer's width); copying all ``width`` columns would move bucket * width * 8 bytes
    # per step (16 MB at 256 rows of a 131072-token model).  Columns past them keep stale
    # entries in the buffer, which no row reads.
    block_table: np.ndarray
    context_lens: np.ndarray  # [bucket] int64


def pad_decode_batch(
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    bucket: int,
    width: int,
    block_size: int,
    scratch_block: int,
) -> PaddedDecode | None:
    """Pad decode rows (one token each; row ``i`` at ``positions[i]`` with blocks
    ``block_ids[i]``) to ``bucket`` rows of a ``width``-column block table.

    Padding rows decode token 0 at position 0 in ``scratch_block``; unused table cells hold
    ``scratch_block`` too (never read: a row reads only the blocks its context covers).
    Returns None when a row's context needs more than ``width`` blocks (run eagerly)."""
    n = len(token_ids)
    if not (n == len(positions) == len(block_ids)) or n > bucket:
        raise ValueError(f"{n} rows do not fit bucket {bucket} or the inputs disagree")
    columns = max((p // block_size + 1 for p in positions), default=1)
    if columns > width:
        return None
    table = np.full((bucket, columns), scratch_block, dtype=np.int64)
    pos = np.zeros(bucket, dtype=np.int64)
    pos[:n] = positions
    for i, (p, blocks) in enumerate(zip(positions, block_ids, strict=True)):
        needed = p // block_size + 1
        if needed > width or needed > len(blocks):
            return None
        table[i, :needed] = blocks[:needed]
    slots = np.full(bucket, scratch_block * block_size, dtype=np.int64)
    rows = np.arange(n)
    slots[:n] = table[rows, pos[:n] // block_size] * block_size + pos[:n] % block_size
    ids = np.zeros(bucket, dtype=np.int64)
    ids[:n] = token_ids
    return PaddedDecode(n, bucket, ids, pos, slots, table, pos + 1)


class DecodeGraphs:
    """Static decode buffers and, on CUDA, one captured graph per bucket.

    ``model`` is the runner's model (``forward(token_ids, positions, kv_caches, meta)`` →
    hidden ``[rows, hidden]``; ``compute_logits(hidden)`` → float32 ``[rows, vocab]``;
    ``config.vocab_size``).  Where nothing was captured (CPU tests) :meth:`run` and
    :meth:`greedy` run the same code eagerly on the buffers, so padding, the logits and the
    greedy tail are checked without a GPU."""

    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        sizes: Sequence[int],
        width: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
        use_triton_decode: bool,
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = tuple(sorted(sizes))
        self.width = width
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.use_triton_decode = use_triton_decode
        largest = self.sizes[-1]
        # Device inputs: rows of one [7, largest] buffer (token ids, positions, KV slots,
        # context lengths, and for the sampled tail each row's sampling-table and penalty
        # slots and its grammar flag), so a step moves them with one contiguous copy.
        self._inputs = torch.zeros((_INPUT_ROWS, largest), dtype=torch.int64, device=device)
        (
            self.token_ids,
            self.positions,
            self.slots,
            self.context_lens,
            self.sample_slots,
            self.penalty_slots,
            self.grammar_flags,
        ) = self._inputs.unbind(0)
        self.block_table = torch.zeros((largest, width), dtype=torch.int64, device=device)
        # Host staging, allocated once (pinned on CUDA, so the copies are truly asynchronous),
        # two sets used in turn: the copies of step n may still be queued when step n + 1
        # fills its set, but step n's result was read back (a synchronisation) before step
        # n + 2 reuses the first.
        self._staging = [
            (
                host_buffer((_INPUT_ROWS, largest), torch.int64, device),
                host_buffer((largest, width), torch.int64, device),
            )
            for _ in range(2)
        ]
        self._next_staging = 0
        # What the graphs write: the final norm + LM head's logits, the greedy tail's
        # [token id, its logprob] rows (ids exact in float32 below 2**24, as the sampler's).
        vocab = int(model.config.vocab_size)
        self.logits_buffer = torch.zeros((largest, vocab), dtype=torch.float32, device=device)
        self.greedy_buffer = torch.zeros((largest, 2), dtype=torch.float32, device=device)
        # The sampled tail's packed rows (worker/sampled_tail.py) and what it reads.
        self.sample_buffer = torch.zeros(
            (largest, packed_width(vocab)), dtype=torch.float32, device=device
        )
        self._sources: TailSources | None = None
        # Constrained steps' packed bitmask rows (read where a row's grammar flag is set),
        # staged in a pinned buffer allocated once.
        words = grammar_words(vocab)
        self.grammar_words = torch.zeros((largest, words), dtype=torch.int32, device=device)
        self._grammar_staging = host_buffer((largest, words), torch.int32, device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._greedy_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._sampled_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._bucket: int | None = None  # the bucket the last run replayed
        self.capture_seconds = 0.0
        self.num_runs = 0  # steps served from the buffers (tests check the path was taken)
        self._reset_to_padding()

    def _reset_to_padding(self) -> None:
        """Every row a padding row (scratch block, position 0): what capture runs on."""
        self.token_ids.zero_()
        self.positions.zero_()
        self.slots.fill_(self.scratch_block * self.block_size)
        self.block_table.fill_(self.scratch_block)
        self.context_lens.fill_(1)
        pad, zero = self._padding_slots()
        self.sample_slots.fill_(pad)
        self.penalty_slots.fill_(zero)
        self.grammar_flags.zero_()

    def _padding_slots(self) -> tuple[int, int]:
        """The sampling-table and penalty slots padding rows read (neutral, zero)."""
        if self._sources is None:
            return 0, 0
        return self._sources.padding_slot, self._sources.zero_slot

    def bind_sampling(self, table: SamplingTable, penalties: PenaltyCounts) -> None:
        """Sample in the graphs from ``table`` and ``penalties`` (before :meth:`capture`,
        which then captures a sampled tail per bucket over their tensors)."""
        self._sources = TailSources.of(table, penalties)
        self._reset_to_padding()

    def _meta(self, size: int) -> TorchAttentionMetadata:
        return TorchAttentionMetadata(
            slots=self.slots[:size],
            num_decodes=size,
            decode_blocks=self.block_table[:size].reshape(-1),  # a view: rows are contiguous
            decode_max_blocks=self.width,
            decode_positions=self.positions[:size],
            decode_context_lens=self.context_lens[:size],
            prefills=[],
            device=self.device,
            use_triton_decode=self.use_triton_decode,
        )

    def _forward(self, size: int) -> torch.Tensor:
        """A bucket's graph: the forward, then the final norm and the LM head into the
        logits buffer.  Returns the hidden states (before the final norm)."""
        out: torch.Tensor = self.model(
            self.token_ids[:size], self.positions[:size], self.kv_caches, self._meta(size)
        )
        self.logits_buffer[:size].copy_(self.model.compute_logits(out))
        return out

    def _greedy_tail(self, size: int) -> None:
        """A bucket's greedy tail: the sampler's greedy ops over the logits buffer (first
        argmax, the chosen token's ``log_softmax``), packed as it packs them."""
        logits = self.logits_buffer[:size]
        token_ids = logits.argmax(dim=-1)  # [size]
        chosen = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None])  # [size, 1]
        self.greedy_buffer[:size].copy_(
            torch.cat((token_ids.to(torch.float32)[:, None], chosen), 1)
        )

    def _sampled_tail(self, size: int) -> None:
        """A bucket's sampled tail: :func:`~genserve.worker.sampled_tail.sample_tail` over
        the logits buffer into the sample buffer."""
        assert self._sources is not None
        sample_tail(
            self.logits_buffer[:size],
            self.sample_slots[:size],
            self.penalty_slots[:size],
            self._sources,
            self.sample_buffer[:size],
            (self.grammar_words[:size], self.grammar_flags[:size]),
        )

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def capture(self) -> None:
        """Capture every bucket once (one warm-up run first), largest first, into one
        shared pool.  Raises on failure (the runner then logs a warning and stays eager)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                self._reset_to_padding()
                self._forward(size)  # lazy inits (Triton compile, cuBLAS handles) stay outside
                self._greedy_tail(size)
                if self._sources is not None:  # padding rows only: no count changes
                    self._sampled_tail(size)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[size] = self._forward(size)
                self._graphs[size] = graph
                tail = torch.cuda.CUDAGraph()
                with torch.cuda.graph(tail, pool=pool, stream=stream):
                    self._greedy_tail(size)
                self._greedy_graphs[size] = tail
                if self._sources is not None:
                    sampled = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(sampled, pool=pool, stream=stream):
                        self._sampled_tail(size)
                    self._sampled_graphs[size] = sampled
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def release(self) -> None:
        """Drop the graphs, their outputs and the buffers, so that the memory pool and the
        KV cache the graphs reference can be freed."""
        self._graphs.clear()
        self._greedy_graphs.clear()
        self._sampled_graphs.clear()
        self._outputs.clear()
        self._sources = None
        self.kv_caches = []
        self.model = None

    def run(
        self,
        padded: PaddedDecode,
        sample_slots: Sequence[int] = (),
        penalty_slots: Sequence[int] = (),
        constrained_rows: Sequence[int] = (),
        fill: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[num_rows, hidden]`` of a padded decode step (valid until the next
        call: they live in the graph's output buffer); :meth:`logits`, :meth:`greedy` and
        :meth:`sampled` then read the same step.  ``sample_slots`` / ``penalty_slots``: each
        row's slots for the sampled tail (empty: the step will not replay it);
        ``constrained_rows``: the rows whose grammar mask :meth:`stage_grammar` will give.
        ``fill(token_ids)``: called on the device token input after the step's input copy,
        before the replay: placeholder rows take the last step's sampled ids there, on the
        device (overlapped scheduling: that step may not have been read back yet)."""
        b = padded.bucket
        self._bucket = b
        inputs, table = self._staging[self._next_staging]
        self._next_staging ^= 1
        host = inputs.numpy()
        host[0, :b] = padded.token_ids
        host[1, :b] = padded.positions
        host[2, :b] = padded.slots
        host[3, :b] = padded.context_lens
        pad, zero = self._padding_slots()
        n = len(sample_slots)
        host[4, :n] = sample_slots
        host[4, n:b] = pad
        host[5, :n] = penalty_slots
        host[5, n:b] = zero
        host[6, :b] = 0
        host[6, list(constrained_rows)] = 1
        columns = padded.block_table.shape[1]
        table.numpy()[:b, :columns] = padded.block_table
        # Whole rows: one contiguous copy (a [b, columns] slice of the [b, width] buffer
        # would go through a temporary and a scatter kernel); columns past ``columns`` hold
        # stale ids that no row reads.
        self._inputs.copy_(inputs, non_blocking=True)
        self.block_table[:b].copy_(table[:b], non_blocking=True)
        if fill is not None:
            fill(self.token_ids)
        self.num_runs += 1
        graph = self._graphs.get(b)
        if graph is None:  # not captured (CPU tests): the same forward, eagerly
            return self._forward(b)[: padded.num_rows]
        graph.replay()
        return self._outputs[b][: padded.num_rows]

    def logits(self, num_rows: int) -> torch.Tensor:
        """float32 ``[num_rows, vocab]`` logits of the last :meth:`run`'s first rows
        (``model.compute_logits`` of its hidden states, computed in the graph)."""
        return self.logits_buffer[:num_rows]

    def greedy(self, num_rows: int) -> torch.Tensor:
        """float32 ``[num_rows, 2]``: for each of the last :meth:`run`'s first rows, its
        argmax token id and that token's log-probability (replays the greedy tail)."""
        b = self._bucket
        if b is None:
            raise RuntimeError("greedy() reads the step run() replayed: run() first")
        tail = self._greedy_graphs.get(b)
        if tail is None:  # not captured (CPU tests): the same ops, eagerly
            self._greedy_tail(b)
        else:
            tail.replay()
        return self.greedy_buffer[:num_rows]

    def can_sample(self, table: SamplingTable, penalties: PenaltyCounts, penalised: bool) -> bool:
        """Whether :meth:`sampled` can serve a step of ``table`` / ``penalties`` (see
        ``TailSources.current``) from the last :meth:`run`'s bucket."""
        sources = self._sources
        if sources is None or not sources.current(table, penalties, penalised):
            return False
        # Captured without a tail (bound after capture): sample eagerly.
        return not self._graphs or self._bucket in self._sampled_graphs

    def stage_grammar(self, bitmask: torch.Tensor, rows: Sequence[int]) -> bool:
        """Copy a constrained step's packed bitmask (a host tensor, ``bitmask[i]`` for row
        ``rows[i]``; the rows :meth:`run` was told) to the device for the sampled tail: one
        ``non_blocking`` copy of whole rows.  False (sample eagerly) for a mask on the
        device or wider than the logits."""
        b = self._bucket
        words = self.grammar_words.shape[1]
        if b is None or bitmask.device.type != "cpu" or bitmask.shape[1] > words:
            return False
        staging = self._grammar_staging.numpy()
        staging[list(rows), : bitmask.shape[1]] = bitmask.numpy()
        staging[list(rows), bitmask.shape[1] :] = 0  # past the mask: not allowed
        self.grammar_words[:b].copy_(self._grammar_staging[:b], non_blocking=True)
        return True

    def sampled(
        self, num_rows: int, table: SamplingTable, penalties: PenaltyCounts, penalised: bool
    ) -> torch.Tensor | None:
        """float32 ``[num_rows, packed_width]``: the last :meth:`run`'s first rows sampled
        by the sampled tail (replayed; the slots' output and penalty counts advanced), or
        None when the tail does not read ``table`` / ``penalties`` (none bound, or they were
        reallocated since capture: see ``TailSources.current``)."""
        b = self._bucket
        if b is None:
            raise RuntimeError("sampled() reads the step run() replayed: run() first")
        if not self.can_sample(table, penalties, penalised):
            return None
        tail = self._sampled_graphs.get(b)
        if tail is None:  # not captured (CPU tests): the same ops, eagerly
            self._sampled_tail(b)
        else:
            tail.replay()
        return self.sample_buffer[:num_rows]


def measure_capture_bytes(build: Any, device: torch.device) -> int:
    """Device memory the graphs take, measured by capturing them once (``build()`` returns a
    :class:`DecodeGraphs` over a throw-away cache) and releasing them: free memory before
    minus free memory after capture, pool and graph executables included."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info(device)
    graphs = build()
    graphs.capture()
    torch.cuda.synchronize(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    del graphs
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(0, free_before - free_after)
