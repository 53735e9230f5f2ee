"""The sampled tail (worker/sampled_tail.py, issue #29), the part of a decode step a CUDA graph
holds after the LM head, samples exactly what the sync-free sampler samples: the same ids,
logprobs and top alternatives for every kind of row the tail takes, greedy and padding rows
mixed in, and leaves the slots' output counts and penalty counts as the runner leaves them
after an eager step.  A seeded row draws the same token alone and in a batch."""

from __future__ import annotations

import torch

from genserve.step import NewRequestData, SamplingParams
from genserve.worker.device_io import DeviceIO
from genserve.worker.graph_plan import sampling_state
from genserve.worker.request_state import PenaltyCounts
from genserve.worker.sampled_tail import (
    TailSources,
    grammar_words,
    graphable,
    packed_width,
    sample_tail,
)
from genserve.worker.sampler import TOP_WIDTH, Sampler, SamplerOutput, SamplingRow, unpack
from genserve.worker.sampling_table import (
    BIAS_WIDTH,
    SamplingTable,
    uses_output_count,
)

CPU = torch.device("cpu")
VOCAB = 4096
PROMPT = (5, 9, 5, 17, 3, 9, 9)  # repeated tokens: the penalties bite
OUTPUT = 2  # of which the last two are output tokens
# A step's grammar: packed bitmask rows (xgrammar's int32 layout) and the row of each.
Grammar = tuple[torch.Tensor, list[int]]

KINDS = [
    SamplingParams(),
    SamplingParams(num_top_tokens=3),
    SamplingParams(temperature=0.8, seed=5),
    SamplingParams(temperature=1.1, top_k=20, seed=6),
    SamplingParams(temperature=0.9, top_p=0.8, seed=7),
    SamplingParams(temperature=1.0, top_p=0.9999, seed=8),  # past the 64 candidates
    SamplingParams(temperature=1.0, min_p=0.05, seed=9),
    SamplingParams(temperature=1.0, typical_p=0.6, seed=10),
    SamplingParams(repetition_penalty=1.3),  # greedy with a penalty
    SamplingParams(temperature=0.7, frequency_penalty=0.4, presence_penalty=0.3, seed=11),
    SamplingParams(temperature=0.9, output_frequency_penalty=0.5, seed=2**64 - 3),
    SamplingParams(output_frequency_penalty=0.5),
    SamplingParams(logit_bias=((3, 5.0), (7, -2.0))),
    SamplingParams(temperature=0.6, top_k=5, top_p=0.9, num_top_tokens=2, seed=12),
    # A ban still active (2 outputs < 4) and one that ended; ids to ban include the argmax.
    SamplingParams(min_new_tokens=4, min_tokens_banned_ids=(0, 1, 2)),
    SamplingParams(temperature=0.5, min_new_tokens=1, min_tokens_banned_ids=(0,), seed=13),
]


class _State:
    """A table and penalty counts holding one request per kind (plus the padding slot)."""

    def __init__(self, kinds: list[SamplingParams]) -> None:
        self.io = DeviceIO(CPU, explicit=True)
        self.table, self.penalties = sampling_state(VOCAB, CPU, self.io, graphs=True)
        self.kinds = kinds
        self.ids = [f"r{i}" for i in range(len(kinds))]
        self.sources = TailSources.of(self.table, self.penalties)
        self.steps = 0
        for req_id, p in zip(self.ids, kinds, strict=True):
            self.table.add(req_id, p, len(PROMPT) - OUTPUT, OUTPUT)
            if p.uses_penalties:
                new = NewRequestData(req_id, PROMPT, len(PROMPT) - OUTPUT, OUTPUT, p)
                self.penalties.add(new)

    def rows(self) -> list[SamplingRow]:
        """The rows as the runner builds them (``steps`` tokens after registration)."""
        rows = []
        n = OUTPUT + self.steps
        for req_id, p in zip(self.ids, self.kinds, strict=True):
            counts = output = None
            if req_id in self.penalties:
                counts, output = self.penalties.rows(req_id)
            rows.append(SamplingRow(p, n, len(PROMPT) - OUTPUT + n, counts, output))
        return rows

    def eager(self, logits: torch.Tensor, grammar: Grammar | None = None) -> SamplerOutput:
        """The sync-free sampler reading the table, then what the runner does after it."""
        rows = self.rows()
        table_rows = self.table.rows(self.ids)
        bitmask, constrained = grammar if grammar is not None else (None, [])
        sampler = Sampler(CPU, self.io)
        out = sampler(logits.clone(), rows, bitmask, constrained, table=table_rows)
        counted = [i for i, r in enumerate(rows) if uses_output_count(r.params)]
        self.table.advance(table_rows.subset(torch.tensor(counted)))
        penalised = [i for i, r in enumerate(self.ids) if r in self.penalties]
        assert out.device_token_ids is not None
        self.penalties.record(
            [self.ids[i] for i in penalised], out.device_token_ids[torch.tensor(penalised)]
        )
        self.steps += 1
        return out

    def tail(
        self, logits: torch.Tensor, padding: int = 0, grammar: Grammar | None = None
    ) -> SamplerOutput:
        """The tail over the rows and ``padding`` padding rows, as a graph bucket runs it."""
        slots = [self.table.slot(r) for r in self.ids] + [self.sources.padding_slot] * padding
        zero = self.penalties.zero_slot
        penalty_slots = [self.penalties.slot_or_zero(r) for r in self.ids] + [zero] * padding
        pad = torch.zeros(padding, VOCAB)
        bucket = torch.cat((logits, pad))
        out = torch.full((len(slots), packed_width(VOCAB)), float("nan"))
        # The graphs' grammar buffers: stale words where the flag is 0 (never read).
        shape = (len(slots), grammar_words(VOCAB))
        words = torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32)
        flags = torch.zeros(len(slots), dtype=torch.int64)
        if grammar is not None:
            bitmask, constrained = grammar
            words[constrained] = bitmask
            flags[constrained] = 1
        sample_tail(
            bucket,
            torch.tensor(slots),
            torch.tensor(penalty_slots),
            self.sources,
            out,
            (words, flags),
        )
        self.steps += 1
        return unpack(out[: len(self.ids)].tolist(), self.kinds, TOP_WIDTH)


def _logits(rows: int, trial: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + trial)
    x = torch.randn(rows, VOCAB, generator=generator) * (2 + trial)
    if rows == len(KINDS):
        # Token 9, twice in the prompt's output part, loses the argmax to the penalties.
        x[8, 9] = x[8].max() + 0.1
        x[11, 9] = x[11].max() + 0.5
        x[12, 3] = x[12].max() - 1.0  # the +5 bias makes it the argmax
        x[14, :3] = 50.0  # banned while the ban lasts
        x[15, 0] = 50.0  # the ban ended: taken
    return x


def test_every_kind_of_row_is_graphable() -> None:
    rows = _State(KINDS).rows()
    assert all(graphable(r) for r in rows)
    too_many = SamplingParams(logit_bias=tuple((i, 1.0) for i in range(BIAS_WIDTH + 1)))
    assert not graphable(SamplingRow(too_many, 0))
    assert not graphable(SamplingRow(SamplingParams(watermark=True), 0))
    assert not graphable(SamplingRow(SamplingParams(num_top_tokens=TOP_WIDTH + 1), 0))


def test_tail_samples_what_the_sync_free_sampler_samples() -> None:
    eager, tail = _State(KINDS), _State(KINDS)
    for trial in range(3):  # state carries over: counts and output indices advance
        logits = _logits(len(KINDS), trial)
        expected = eager.eager(logits)
        got = tail.tail(logits, padding=5)
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
        assert got.top_tokens == expected.top_tokens
        # The slots' output counts and the penalty counts advanced the same way (padding
        # rows changed nothing: the neutral slot is not counted, the zero row stays zero).
        assert torch.equal(tail.table.ints, eager.table.ints)
        assert torch.equal(tail.penalties.table, eager.penalties.table)
        assert not tail.penalties.table[:, tail.penalties.zero_slot].any()
        # The bias moved the argmax; the active ban kept the banned ids out; the row
        # whose ban ended takes its most likely token.
        assert got.token_ids[8] != 9 and got.token_ids[11] != 9
        assert got.token_ids[12] == 3
        assert got.token_ids[14] not in (0, 1, 2) or trial == 2  # 4 outputs: ban over
        assert got.token_ids[15] == 0


def test_a_seeded_row_draws_the_same_alone_and_in_a_batch() -> None:
    logits = _logits(len(KINDS), 0)
    batch = _State(KINDS).tail(logits, padding=3)
    for i in (2, 4, 9, 13):
        alone = _State([KINDS[i]]).tail(logits[i : i + 1])
        assert alone.token_ids == [batch.token_ids[i]]


def test_reallocated_sources_send_steps_back_to_the_eager_sampler() -> None:
    io = DeviceIO(CPU, explicit=True)
    table, penalties = SamplingTable(CPU, io, capacity=2), PenaltyCounts(VOCAB, CPU, io, 1)
    sources = TailSources.of(table, penalties)  # the padding slot takes one of the two
    assert sources.current(table, penalties, penalised=True)
    params = SamplingParams(repetition_penalty=1.2)
    penalties.add(NewRequestData("a", PROMPT, len(PROMPT), 0, params))
    penalties.add(NewRequestData("b", PROMPT, len(PROMPT), 0, params))  # grows
    assert not sources.current(table, penalties, penalised=True)
    assert sources.current(table, penalties, penalised=False)  # reads only the zero row
    table.add("a", params, 3, 0)
    table.add("b", params, 3, 0)  # grows
    assert not sources.current(table, penalties, penalised=False)


def test_grammar_masks_apply_in_the_tail_as_in_the_sampler() -> None:
    """Constrained rows (greedy, sampled, penalised, biased) get their bitmask, the others
    none, whatever stale words their rows of the buffer hold."""
    constrained = [0, 3, 8, 12, 13]
    generator = torch.Generator().manual_seed(5)
    eager, tail = _State(KINDS), _State(KINDS)
    for trial in range(2):
        # Sparse masks (a structural position: few tokens allowed) and dense ones.
        dense = torch.rand(len(constrained), VOCAB, generator=generator) < 0.5
        sparse = torch.rand(len(constrained), VOCAB, generator=generator) < 0.01
        allowed = torch.where(torch.tensor([1, 0, 1, 0, 1])[:, None] == 1, sparse, dense)
        allowed[:, 7] = True  # never empty
        bits = torch.nn.functional.pad(allowed, (0, 32 * grammar_words(VOCAB) - VOCAB))
        weights = 1 << torch.arange(32, dtype=torch.int64)
        packed = (bits.view(len(constrained), -1, 32).long() * weights).sum(-1)
        bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        logits = _logits(len(KINDS), trial)
        expected = eager.eager(logits, (bitmask, constrained))
        got = tail.tail(logits, padding=3, grammar=(bitmask, constrained))
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs
        assert got.top_tokens == expected.top_tokens
        for i, row in enumerate(constrained):
            assert allowed[i, got.token_ids[row]]
        assert torch.equal(tail.table.ints, eager.table.ints)
        assert torch.equal(tail.penalties.table, eager.penalties.table)
