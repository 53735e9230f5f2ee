"""The sampled tail of a decode step: sampling with fixed shapes, so a CUDA graph can hold it
(issue #29: "the LM head, final norm and greedy/seeded sampling go inside the graph").

:func:`sample_tail` takes a bucket's logits and, for each row, the request's slot in the
:class:`~genserve.worker.sampling_table.SamplingTable` and in the
:class:`~genserve.worker.request_state.PenaltyCounts`, and does on the device, with shapes
that depend on the bucket only, what :class:`~genserve.worker.sampler.Sampler` does on its
sync-free path: logit bias and ``min_new_tokens`` bans, repetition / frequency / presence
penalties, the grammar bitmask of constrained rows, greedy argmax, temperature, top-k,
top-p, min-p, typical-p and the seeded draw; then it packs ids, logprobs and the top
alternatives into one block (the step's readback) and advances the slots' output counts and
penalty counts, as the runner does after an eager step.  Every parameter is read from the
per-slot tensors, which persist across steps and change only when a request is registered;
a step uploads nothing but each row's slots and grammar flag (rows of the graph's one input
copy) and, when it has constrained rows, their bitmask.

Where the eager sampler skips a filter no row uses, the tail applies it to every row with
the row's own value, and a neutral value leaves a row bit for bit as it was (a top-k of 0
cuts at ``-inf``, a top-p of 1 removes nothing, ``log(min_p = 0)`` is ``-inf``, a penalty
of 0 subtracts 0, a repetition penalty reads zero counts).  Greedy and padding rows use
top-p 1, so top-p's batch-wide candidate choice is the one the eager sampler makes over the
sampled rows.  The k-th largest score comes from a full sort rather than ``topk(max k)``:
the same value either way.

Randomness.  Each sampled row's draw is one uniform number, a splitmix64 hash of the
request's seed and output index computed on the device
(:func:`~genserve.worker.sampling_table.device_uniform`): counter-based, so a graph replay
needs no generator state and a request draws the same tokens with graphs on or off, alone
or in any batch, with overlap on or off (its output index comes from the slot, not the step).
Unseeded requests have a seed drawn by the engine, so no device generator state is needed.

Grammar masks: the step's packed bitmask (xgrammar's int32 layout) is uploaded, when a step
has constrained rows, into a static ``[rows, words]`` buffer, and each row's flag (in the
step's inputs) says whether its mask applies; the bits are unpacked on the device, tokens
past the mask's width are disallowed (as worker/grammar_mask.py's CPU path does).

What stays with the eager sampler (:func:`graphable`): the watermark (a ``randperm`` per
previous token), a bitmask wider than the logits or already on the device, more than
:data:`~genserve.worker.sampler.TOP_WIDTH` alternatives, more logit-bias entries or banned
ids than a slot holds, and speculative chunks (several rows per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from genserve.worker.logits_processors import min_p_filter
from genserve.worker.request_state import PenaltyCounts
from genserve.worker.sampler import TOP_WIDTH, SamplingRow
from genserve.worker.sampling_filters import draw, top_p_sync_free, typical_p_filter
from genserve.worker.sampling_table import (
    _MIN_NEW,
    _NUM_OUTPUT,
    _NUM_PROMPT,
    _SEED,
    _TOP_K,
    BAN_WIDTH,
    BIAS_WIDTH,
    FLOAT_COLUMNS,
    SamplingTable,
    device_uniform,
)


def graphable(row: SamplingRow) -> bool:
    """Whether the sampled tail samples ``row`` (else the step goes to the eager sampler)."""
    p = row.params
    return (
        not p.watermark
        and p.num_top_tokens <= TOP_WIDTH
        and len(p.logit_bias) <= BIAS_WIDTH
        and len(p.min_tokens_banned_ids) <= BAN_WIDTH
    )


def packed_width(vocab: int) -> int:
    """Columns of the tail's packed block: id, logprob, top ids, top logprobs."""
    return 2 + 2 * min(TOP_WIDTH, vocab)


@dataclass(frozen=True, eq=False)
class TailSources:
    """The per-slot tensors a captured tail reads (held here, so a graph's addresses stay
    valid) and the generations they were taken at."""

    table: SamplingTable
    penalties: PenaltyCounts
    table_generation: int
    penalty_generation: int
    padding_slot: int
    zero_slot: int
    tensors: tuple[torch.Tensor, ...] = field(repr=False)

    @classmethod
    def of(cls, table: SamplingTable, penalties: PenaltyCounts) -> TailSources:
        padding = table.padding_slot()  # may upload: made before any capture
        held = (
            table.floats,
            table.ints,
            table.bias_ids,
            table.bias_values,
            table.ban_ids,
            penalties.table,
        )
        return cls(
            table,
            penalties,
            table.generation,
            penalties.generation,
            padding,
            penalties.zero_slot,
            held,
        )

    def current(self, table: SamplingTable, penalties: PenaltyCounts, penalised: bool) -> bool:
        """Whether a step of this table (and, if ``penalised``, these counts) may replay a
        tail captured over these sources.  A step without penalties reads only the zero row
        of the counts, which stays zero in a reallocated-away table too."""
        if table is not self.table or table.generation != self.table_generation:
            return False
        return not penalised or (
            penalties is self.penalties and penalties.generation == self.penalty_generation
        )


def grammar_words(vocab: int) -> int:
    """int32 words of a packed bitmask covering ``vocab`` tokens."""
    return -(-vocab // 32)


def allowed_tokens(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[n, vocab]`` from packed int32 ``[n, words]`` (bit ``j % 32`` of word
    ``j // 32`` is token ``j``, xgrammar's layout); tokens past the words are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)
    if bits.shape[1] < vocab:
        bits = torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]))
    return bits[:, :vocab] != 0


def sample_tail(
    logits: torch.Tensor,
    slots: torch.Tensor,
    penalty_slots: torch.Tensor,
    sources: TailSources,
    out: torch.Tensor,
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Sample every row of ``logits`` (float32 ``[n, vocab]``; row ``i`` belongs to table
    slot ``slots[i]`` and penalty slot ``penalty_slots[i]``, int64 on the device) into
    ``out`` (float32 ``[n, packed_width(vocab)]``), then advance the slots' output counts
    and penalty counts.  ``grammar``: packed bitmask rows (int32 ``[n, words]``) and each
    row's flag (int64 ``[n]``, nonzero: the row's mask applies).  No host value is read, no
    shape depends on a value."""
    floats, ints, bias_ids, bias_values, ban_ids, counts_table = sources.tensors
    vocab = logits.shape[-1]
    f = floats.index_select(1, slots)  # [F, n]
    temperature, top_p, min_p, typical_p, rep, freq, presence, out_freq = (
        f[FLOAT_COLUMNS.index(name)] for name in FLOAT_COLUMNS
    )
    i = ints.index_select(1, slots)  # [5, n]
    top_k, seed, num_prompt, num_output, min_new = (
        i[c] for c in (_TOP_K, _SEED, _NUM_PROMPT, _NUM_OUTPUT, _MIN_NEW)
    )
    logprobs = torch.log_softmax(logits, dim=-1)  # the model's own distribution

    # Logit bias (unused entries: id -1, value 0, added to token 0: x + 0 == x), then bans.
    scores = logits.clone()
    bias = bias_ids.index_select(0, slots)  # [n, BIAS_WIDTH]
    scores.scatter_add_(1, bias.clamp(min=0), bias_values.index_select(0, slots))
    bans = ban_ids.index_select(0, slots)  # [n, BAN_WIDTH]
    active = (bans >= 0) & (num_output < min_new)[:, None]
    banned = torch.zeros_like(scores).scatter_add_(1, bans.clamp(min=0), active.to(scores.dtype))
    scores = scores.masked_fill(banned > 0, float("-inf"))

    # Penalties: the Sampler's formulas, over every row (zero counts for rows without).
    counts = counts_table[0].index_select(0, penalty_slots)  # [n, vocab]
    output = counts_table[1].index_select(0, penalty_slots)
    penalised = torch.where(scores < 0, scores * rep[:, None], scores / rep[:, None])
    scores = torch.where(counts > 0, penalised, scores)
    lengths = (num_prompt + num_output).clamp(min=1)
    scores = scores - counts / lengths[:, None] * freq[:, None]
    scores = scores - (output > 0).to(scores.dtype) * presence[:, None]
    scores = scores - output * out_freq[:, None]
    if grammar is not None:  # after the penalties, before temperature (as the sampler)
        words, flags = grammar
        keep = allowed_tokens(words, vocab) | (flags == 0)[:, None]
        scores = scores.masked_fill(~keep, float("-inf"))
    greedy_ids = scores.argmax(dim=-1)

    # Sampled rows: temperature, filters, the seeded draw.
    sampled = temperature != 0.0
    scores = scores / torch.where(sampled, temperature, 1.0)[:, None]
    kth = scores.sort(dim=-1, descending=True).values
    index = (torch.where(top_k > 0, top_k.clamp(max=vocab), vocab) - 1)[:, None]
    threshold = kth.gather(1, index).masked_fill((top_k == 0)[:, None], float("-inf"))
    scores = scores.masked_fill(scores < threshold, float("-inf"))
    scores = top_p_sync_free(scores, torch.where(sampled, top_p, 1.0))
    scores = min_p_filter(scores, min_p)
    scores = typical_p_filter(scores, typical_p)
    drawn = draw(scores, device_uniform(seed, num_output), sync_free=True)
    token_ids = torch.where(sampled, drawn, greedy_ids)

    chosen = logprobs.gather(1, token_ids[:, None])  # [n, 1]
    top_values, top_ids = logprobs.topk(min(TOP_WIDTH, vocab), dim=-1)
    out.copy_(
        torch.cat((token_ids.to(torch.float32)[:, None], chosen, top_ids.float(), top_values), 1)
    )

    # What the runner does after an eager step: one more output token for the rows that
    # read their count (padding rows: the neutral slot, not counted), and the new tokens
    # counted for the rows with penalties (weight 0 into the zero row for the others).
    counted = sampled | (freq != 0.0) | (min_new > 0)
    ints[_NUM_OUTPUT].index_add_(0, slots, counted.to(torch.int64))
    weights = (penalty_slots != sources.zero_slot).to(counts_table.dtype)
    base = penalty_slots * vocab + token_ids
    plane = counts_table.shape[1] * vocab
    counts_table.view(-1).scatter_add_(
        0, torch.cat((base, base + plane)), torch.cat((weights, weights))
    )
