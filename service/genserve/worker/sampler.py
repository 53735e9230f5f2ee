"""Logits → next tokens for a batch of rows with heterogeneous sampling parameters.

Order of operations (TGI's, presence penalty after frequency as vLLM applies them
together; logit bias and min_new_tokens bans first and min-p after top-p as in
worker/logits_processors.py): logit bias / bans → repetition penalty → frequency penalty →
presence penalty → temperature → top-k → top-p → min-p → typical-p → draw.  Greedy rows
take the argmax after the penalties.  Every filter is one tensor operation over the rows
that use it; rows that leave a parameter at its neutral value are not touched.

Randomness is a pure function of ``(seed, output_index)``: each sampled row takes one
uniform number from a splitmix64 hash of both and picks its token by inverse CDF (the first
token whose cumulative probability exceeds it).  A seeded request therefore samples the same
tokens whatever else is in the batch, after a preemption recomputes it, and when its
positions are verified several at a time (speculative decoding).  One number per row, not a
vocabulary's worth of noise from a per-row generator: that cost 27 ms per step at 32 rows.

Reported logprobs (chosen token and top alternatives) are those of the unmodified model
distribution, ``log_softmax(logits)``, before penalties and temperature.

Synchronisation (issue #29).  Per-row parameters are built on the host and uploaded through
:class:`~genserve.worker.device_io.DeviceIO` (pinned, ``non_blocking``); row subsets are
indexed with uploaded index tensors, never Python lists; decisions that depend on values
(is a row's top-p mass inside the first candidates? did a draw land on a filtered token?)
are taken on the device in the *sync-free* mode, which is the mode of any device with real
transfers (CUDA).  The token ids, their logprobs and the top alternatives leave the device
packed in one float32 block (token ids are exact in float32 below 2**24), in one copy: the
step's only device → host transfer and its only wait.  On the CPU the value-dependent fast
paths (C++ greedy stats, top-p over 64 candidates) stay: there is no device to wait for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.step import SamplingParams, TokenLogprob
from genserve.worker.device_io import DeviceIO, PendingRead, Readback
from genserve.worker.logits_processors import apply_logit_controls, min_p_filter
from genserve.worker.sampling_filters import (
    draw,
    top_k_filter,
    top_p_filter,
    top_p_sync_free,
    typical_p_filter,
)
from genserve.worker.watermark import watermark_rows

if TYPE_CHECKING:
    from genserve.worker.grammar_mask import BitmaskApplier
    from genserve.worker.sampling_table import TableRows

_MASK64 = (1 << 64) - 1


def row_uniform(seed: int, output_index: int) -> float:
    """The row's uniform draw in ``[0, 1)``: the top 53 bits of :func:`row_seed`."""
    return (row_seed(seed, output_index) >> 10) * 2.0**-53


def row_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed mixing the request seed and the output position (splitmix64
    finaliser), so consecutive positions get unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs about the request behind one row of logits.

    ``token_counts`` (``[vocab]`` float32, occurrences over prompt + output) is required
    only when the request uses a repetition or frequency penalty; ``num_tokens`` is the
    prompt + output length, which normalises the frequency penalty as TGI does.
    """

    params: SamplingParams
    output_index: int
    num_tokens: int = 0
    token_counts: torch.Tensor | None = None
    # [vocab] float32 occurrences over the output only; required with a presence penalty.
    output_counts: torch.Tensor | None = None
    prev_token: int = -1  # the token before this position (seeds the watermark green list)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_tokens: list[tuple[TokenLogprob, ...]]
    # The same token ids, still on the device ([num_rows] int64): penalty counts are updated
    # from them without a round trip through the host.
    device_token_ids: torch.Tensor | None = None


# Token ids travel in the packed float32 readback: exact below 2**24.
_MAX_PACKED_ID = 1 << 24
# Top alternatives the sync-free path ranks whenever a row asks for at most this many: the
# sampled tail captured in a CUDA graph ranks this many every step (a fixed shape), and the
# eager path ranks as many so that tied logprobs come out in the same order either way.
TOP_WIDTH = 20


class PendingSamples:
    """A step's sampled tokens whose one readback is in flight (queued, not waited on):
    the token ids are already on the device (``device_token_ids``, what the next step's
    placeholders and the penalty counts read), the host values come with :meth:`result`.

    ``finish`` turns the packed host rows into the :class:`SamplerOutput`."""

    def __init__(
        self,
        read: PendingRead,
        finish: Callable[[list[list[float]]], SamplerOutput],
        device_token_ids: torch.Tensor | None,
    ) -> None:
        self._read = read
        self._finish = finish
        self.device_token_ids = device_token_ids
        self._result: SamplerOutput | None = None

    def result(self) -> SamplerOutput:
        """Wait for the readback (once) and unpack it."""
        if self._result is None:
            self._result = self._finish(self._read.wait().tolist())
        return self._result


def top_width(max_top: int, sync_free: bool, vocab: int) -> int:
    """How many alternatives are ranked for a step whose widest row asks ``max_top``."""
    if sync_free and 0 < max_top <= TOP_WIDTH:
        return min(TOP_WIDTH, vocab)
    return max_top


def unpack(
    host: list[list[float]],
    params: Sequence[SamplingParams],
    width: int,
    device_token_ids: torch.Tensor | None = None,
) -> SamplerOutput:
    """A :class:`SamplerOutput` from the packed rows ``[id, logprob, width top ids, width
    top logprobs]`` read back from the device (row ``i`` keeps ``params[i]``'s top-n)."""
    ids = [int(row[0]) for row in host]
    top_tokens: list[tuple[TokenLogprob, ...]] = [()] * len(host)
    for i, (p, row) in enumerate(zip(params, host, strict=True)):
        n = p.num_top_tokens
        if n:
            top_tokens[i] = tuple(
                TokenLogprob(int(t), lp)
                for t, lp in zip(row[2 : 2 + n], row[2 + width : 2 + width + n], strict=True)
            )
    return SamplerOutput(ids, [row[1] for row in host], top_tokens, device_token_ids)


def _uses_penalty(p: SamplingParams) -> bool:
    return p.uses_penalties


class Sampler:
    """Logits → tokens; one instance per runner (it keeps the grammar mask's scatter buffer
    and the pinned readback buffer across steps).

    ``io``: how values reach the device (default: plain tensors on the CPU, pinned
    asynchronous copies on CUDA).  ``sync_free``: take no value-dependent branch on the host
    (default: whenever ``io`` makes real transfers)."""

    def __init__(
        self, device: torch.device, io: DeviceIO | None = None, sync_free: bool | None = None
    ) -> None:
        self.device = device
        self.io = io if io is not None else DeviceIO(device)
        self.sync_free = self.io.transfers if sync_free is None else sync_free
        self._readback = Readback(self.io)
        self._grammar_mask: BitmaskApplier | None = None  # made on the first constrained step

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_bitmask: torch.Tensor | None = None,
        grammar_rows: Sequence[int] = (),
        table: TableRows | None = None,
    ) -> SamplerOutput:
        """The sampled tokens of ``rows``: :meth:`launch`, then wait for them."""
        return self.launch(logits, rows, grammar_bitmask, grammar_rows, table).result()

    @torch.inference_mode()
    def launch(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_bitmask: torch.Tensor | None = None,
        grammar_rows: Sequence[int] = (),
        table: TableRows | None = None,
    ) -> PendingSamples:
        """Queue the sampling of ``rows`` and its one readback; nothing waits here.

        ``logits``: float32 ``[num_rows, vocab]``, one row per entry of ``rows``.
        ``grammar_bitmask[i]`` (xgrammar's packed int32 layout) masks row ``grammar_rows[i]``
        after the penalties, before temperature and filtering; other rows are untouched.
        ``table``: the rows' parameters (and seeds, output counts) already on the device
        (worker/sampling_table.py), read instead of uploading them from ``rows``; the
        decisions that need no device value (which filters run) still come from ``rows``."""
        num_rows = len(rows)
        params = [r.params for r in rows]
        max_top = max((p.num_top_tokens for p in params), default=0)
        # Without top alternatives only the chosen tokens' log-probabilities are reported:
        # on CPU one C++ pass gives each row's argmax, maximum and log-sum-exp instead of a
        # [num_rows, vocab] log_softmax and argmax (32 float32 streams: 58.5 -> 56.3 ms a step).
        stats = None if max_top or self.sync_free else _greedy_stats(logits)
        # log_softmax is one vectorised pass (logsumexp + subtract measured 3x slower).
        logprobs = torch.log_softmax(logits, dim=-1) if stats is None else None

        # logit_bias and min_new_tokens bans come first, as vLLM applies them (a copy if any).
        scores = apply_logit_controls(logits, params, [r.output_index for r in rows], self.io)
        scores = watermark_rows(scores, logits, rows)  # TGI: before the penalties
        penalised = [i for i, p in enumerate(params) if _uses_penalty(p)]
        if penalised:
            if scores is logits:
                scores = logits.clone()
            if len(penalised) == num_rows:
                scores = self._apply_penalties(scores, rows, table)
            else:
                index = self.io.upload_cached("penalised_rows", penalised)
                part = self._apply_penalties(
                    scores.index_select(0, index),
                    [rows[i] for i in penalised],
                    table.subset(index) if table is not None else None,
                )
                scores.index_copy_(0, index, part)

        if grammar_bitmask is not None and grammar_rows:
            if scores is logits:
                scores = logits.clone()  # logits stay the model's (prompt logprobs read them)
            if self._grammar_mask is None:
                from genserve.worker.grammar_mask import BitmaskApplier  # constrained steps

                self._grammar_mask = BitmaskApplier()
            self._grammar_mask(scores, grammar_bitmask, list(grammar_rows))

        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if len(sampled) == num_rows:  # no argmax to overwrite
            token_ids = self._sample(scores, rows, table)
        else:
            # [num_rows]; kept for greedy rows (stats' own tensor: nothing else reads it)
            if stats is not None and scores is logits:
                token_ids = stats[0]
            else:
                token_ids = first_argmax(scores, cpu_trick=not self.sync_free)
            if sampled:
                index = self.io.upload_cached("sampled_rows", sampled)
                picked = self._sample(
                    scores.index_select(0, index),
                    [rows[i] for i in sampled],
                    table.subset(index) if table is not None else None,
                )
                token_ids.index_copy_(0, index, picked)

        if stats is not None:  # log_softmax's (x - max) - log(sum(exp(x - max)))
            chosen = (logits.gather(1, token_ids[:, None])[:, 0] - stats[1]) - stats[2]
        else:
            assert logprobs is not None
            chosen = logprobs.gather(1, token_ids[:, None])[:, 0]  # [num_rows]
        return self._read_back(token_ids, chosen, logprobs, params, max_top)

    def _read_back(
        self,
        token_ids: torch.Tensor,
        chosen: torch.Tensor,
        logprobs: torch.Tensor | None,
        params: Sequence[SamplingParams],
        max_top: int,
    ) -> PendingSamples:
        """Everything the host needs, in one float32 block ``[rows, 2 + 2 * max_top]`` (ids,
        their logprobs, top ids, top logprobs) and one copy."""
        parts = [token_ids.to(torch.float32)[:, None], chosen[:, None]]
        width = 0
        if max_top:
            assert logprobs is not None
            width = top_width(max_top, self.sync_free, logprobs.shape[-1])
            top_values, top_ids = logprobs.topk(width, dim=-1)  # [num_rows, width]
            parts += [top_ids.to(torch.float32), top_values]
        if logprobs is not None and logprobs.shape[-1] > _MAX_PACKED_ID:
            raise ValueError(f"vocabulary of {logprobs.shape[-1]} ids: too wide to pack")
        read = self._readback.start(torch.cat(parts, dim=1))
        return PendingSamples(read, lambda host: unpack(host, params, width, token_ids), token_ids)

    def _apply_penalties(
        self, scores: torch.Tensor, rows: Sequence[SamplingRow], table: TableRows | None = None
    ) -> torch.Tensor:
        # scores: [n, vocab] (a copy); counts: [n, vocab]
        counts = torch.stack([_counts(r) for r in rows])
        values = _RowValues(rows, self.io, table)
        rep = values.column("repetition_penalty")[:, None]
        seen = counts > 0
        # HF/TGI repetition penalty: divide positive logits, multiply negative ones.
        penalised = torch.where(scores < 0, scores * rep, scores / rep)
        scores = torch.where(seen, penalised, scores)
        if any(r.params.frequency_penalty != 0.0 for r in rows):
            freq = values.column("frequency_penalty")
            lengths = values.num_tokens()
            scores = scores - counts / lengths[:, None] * freq[:, None]
        if any(r.params.presence_penalty != 0.0 for r in rows):
            presence = values.column("presence_penalty")
            # OpenAI/vLLM: subtracted once for each distinct token already generated.
            present = torch.stack(
                [
                    _output_counts(r) if r.params.presence_penalty != 0.0 else torch.zeros_like(c)
                    for r, c in zip(rows, counts, strict=True)
                ]
            )
            scores = scores - (present > 0).to(scores.dtype) * presence[:, None]
        out_freq = [r.params.output_frequency_penalty for r in rows]
        if any(f != 0.0 for f in out_freq):
            # OpenAI/vLLM frequency_penalty: penalty x times generated so far (issue #27).
            generated = torch.stack(
                [
                    _output_counts(r) if f != 0.0 else torch.zeros_like(c)
                    for r, c, f in zip(rows, counts, out_freq, strict=True)
                ]
            )
            scores = scores - generated * values.column("output_frequency_penalty")[:, None]
        return scores

    def _sample(
        self, scores: torch.Tensor, rows: Sequence[SamplingRow], table: TableRows | None = None
    ) -> torch.Tensor:
        """Draw one token per row from the filtered, tempered distribution."""
        params = [r.params for r in rows]
        values = _RowValues(rows, self.io, table)
        temperature = values.column("temperature")
        scores = scores / temperature[:, None]  # [n, vocab]
        if any(p.top_k > 0 for p in params):
            k = table.top_k() if table is not None else None
            scores = top_k_filter(scores, [p.top_k for p in params], self.io, k)
        if any(p.top_p < 1.0 for p in params):
            if self.sync_free:
                scores = top_p_sync_free(scores, values.column("top_p"))
            else:
                scores = top_p_filter(scores, [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):  # transformers' order: after top-p
            scores = min_p_filter(scores, values.column("min_p"))
        if any(p.typical_p < 1.0 for p in params):
            scores = typical_p_filter(scores, values.column("typical_p"))
        return draw(scores, values.uniform(), self.sync_free)


_ARGMAX_CHUNK = 1024


def _greedy_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``genserve::greedy_stats`` of float32 CPU logits (first argmax, maximum and log-sum-exp
    of each row), or None where torch's path is taken: other devices or dtypes, no CPU
    kernels, or a row that is not all finite (NaN/inf, where torch's semantics decide)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    if not cpu_kernels.enabled_and_loaded():
        return None
    argmax, peak, log_total = torch.ops.genserve.greedy_stats(logits)
    # On the host: a handful of floats, where torch.isfinite(...).all() and its bool() were six
    # small ops (~40 us of a one-stream 135M step of ~6 ms).
    if not all(map(math.isfinite, log_total.tolist())):
        return None
    return argmax, peak, log_total


def first_argmax(x: torch.Tensor, cpu_trick: bool = True) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``[rows, vocab]`` (first index on ties), faster.

    PyTorch's CPU argmax is not vectorised (1 ms for 32 x 49152); the vectorised ``amax``
    over chunks finds each row's first chunk holding the maximum, and argmax then runs only
    inside that chunk.  Falls back to argmax when the vocabulary does not split evenly, and
    off the CPU (or without ``cpu_trick``: the sync-free path mirrors CUDA's ops), where
    argmax is one kernel and the trick would cost seven."""
    rows, vocab = x.shape
    trick = cpu_trick and x.device.type == "cpu"
    if not trick or vocab % _ARGMAX_CHUNK or vocab < 4 * _ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = x.view(rows, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [rows]
    inside = chunks[torch.arange(rows, device=x.device), best_chunk].argmax(dim=-1)
    return best_chunk * _ARGMAX_CHUNK + inside


class _RowValues:
    """Per-row values for a sampling pass: gathered from the device table when there is
    one, otherwise built from ``rows`` and uploaded (tests, callers without a table)."""

    def __init__(self, rows: Sequence[SamplingRow], io: DeviceIO, table: TableRows | None) -> None:
        self.rows = rows
        self.io = io
        self.table = table

    def column(self, name: str) -> torch.Tensor:
        """float32 ``[rows]`` of the ``SamplingParams`` field ``name``."""
        if self.table is not None:
            return self.table.column(name)
        return self.io.upload([getattr(r.params, name) for r in self.rows], torch.float32)

    def num_tokens(self) -> torch.Tensor:
        """int64 ``[rows]``: prompt + output tokens before each row's token (at least 1)."""
        if self.table is not None:
            return self.table.num_tokens().clamp(min=1)
        return self.io.upload([max(r.num_tokens, 1) for r in self.rows], torch.int64)

    def uniform(self) -> torch.Tensor:
        """float64 ``[rows]``: each row's uniform draw (:func:`row_uniform`)."""
        if self.table is not None:
            return self.table.uniform()
        return self.io.upload(
            [row_uniform(r.params.seed, r.output_index) for r in self.rows], torch.float64
        )


def _counts(row: SamplingRow) -> torch.Tensor:
    if row.token_counts is None:
        raise ValueError("a penalised row needs token_counts")
    return row.token_counts


def _output_counts(row: SamplingRow) -> torch.Tensor:
    if row.output_counts is None:
        raise ValueError("a row with an output penalty needs output_counts")
    return row.output_counts
