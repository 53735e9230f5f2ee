"""Proof without a GPU that a decode step does not stall the host (issue #29).

The runner runs its CUDA code path on the CPU: bfloat16, CPU kernels off (every op is one CUDA
would run), every host → device transfer an explicit copy (``explicit_transfers``), the
decode step replayed from DecodeGraphs' static buffers with the Triton decode kernel stubbed
by one custom op, and the model's fused GPU layer ops on (``use_fused_gpu_ops``: each
``genserve_gpu::*`` op is one custom op, its torch reference running below the audit, as the
Triton kernel is one launch on a GPU).  Under :class:`genserve.worker.sync_audit.SyncAudit`
a greedy and a sampled decode step at 1 and 64 rows must show: no blocking host → device
copy, exactly one device → host copy, no ``item()`` / ``tolist()`` / ``bool()`` (or any other
value read) on a device tensor, no host array slipped into a device op, at most 9 kernels in
a decoder layer, the LM head inside what the graphs capture and, for the greedy step,
nothing after the replay but the one copy back.  On a GPU the same steps run under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import triton_attention, triton_varlen_attention
from genserve.kernels.triton_varlen_attention import VarlenBatch
from genserve.model.attention import PrefillAttention, TorchPagedAttention
from genserve.model.loader import ResolvedModel
from genserve.step import (
    NewRequestData,
    RunnerOutput,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from genserve.worker import model_runner
from genserve.worker.cuda_graphs import DecodeGraphs
from genserve.worker.graph_plan import sampling_state
from genserve.worker.model_runner import ModelRunner
from genserve.worker.sync_audit import AuditCounts, SyncAudit
from tests.conftest import TinyModelFactory
from tests.unit.test_sampling_table import _Stream as PlaceholderStream

CPU = torch.device("cpu")
BLOCK_SIZE = 16
NUM_BLOCKS = 80  # one block per request, a scratch block past them
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Kernels in one decoder layer of the decode step (the tiny Llama, attention one kernel):
# 19 with eager torch ops; with the fused GPU ops: add + RMSNorm, QKV, rotary + K/V store,
# attention, O, add + RMSNorm, gate/up, SiLU·mul, down = 9, issue #29's target.
MAX_LAYER_KERNELS = 9
# The model's positions (the tiny models' max_position_embeddings): rotary table rows.
MAX_POSITIONS = 4096

GREEDY = SamplingParams()
SAMPLED = SamplingParams(
    temperature=0.8,
    top_k=20,
    top_p=0.9,
    min_p=0.02,
    typical_p=0.95,
    repetition_penalty=1.1,
    frequency_penalty=0.2,
    presence_penalty=0.1,
    logit_bias=((5, 1.5),),
    num_top_tokens=2,
    seed=7,
)


@torch.library.custom_op("genserve_test::paged_decode", mutates_args=())
def _paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton decode kernel's contract in torch (one op, as the kernel is one launch)."""
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i, length in enumerate(context_lens):  # the kernel's own business: not audited
        n = int(length)
        blocks = block_table[i, : -(-n // block_size)]
        k = kv_cache[0][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :n].float()
        v = kv_cache[1][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :n].float()
        qi = q[i].view(num_kv_heads, group, head_dim).float()
        weights = torch.softmax(qi @ k.transpose(1, 2) * scale, dim=-1)
        out[i] = (weights @ v).reshape(num_heads, head_dim).to(q.dtype)
    return out


@_paged_decode.register_fake
def _(q: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(q)


def _stub_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    assert window is None
    return _paged_decode(q, kv_cache, block_table, context_lens, scale)


@torch.library.custom_op("genserve_test::paged_varlen", mutates_args=())
def _paged_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton whole-step kernel's contract in torch (one op, as the kernel is one
    launch): causal attention of each sequence's queries over its paged context."""
    _, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = [int(x) for x in query_start]  # the kernel's own business: not audited
    for i, n in enumerate(int(x) for x in seq_lens):
        lo, hi = starts[i], starts[i + 1]
        blocks = block_table[i, : -(-n // block_size)]
        k = kv_cache[0][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :n].float()
        v = kv_cache[1][:, blocks].reshape(num_kv_heads, -1, head_dim)[:, :n].float()
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qi = q[lo:hi].transpose(0, 1).float()  # [heads, n_q, hd]
        q_pos = torch.arange(n - (hi - lo), n)[:, None]
        scores = (qi @ k.transpose(1, 2) * scale).masked_fill(
            torch.arange(n)[None, :] > q_pos, float("-inf")
        )
        out[lo:hi] = (torch.softmax(scores, -1) @ v).transpose(0, 1).to(q.dtype)
    return out


@_paged_varlen.register_fake
def _(q: torch.Tensor, *_: object) -> torch.Tensor:
    return torch.empty_like(q)


def _stub_varlen(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: VarlenBatch,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    assert window is None and softcap is None and sinks is None
    return _paged_varlen(q, kv_cache, batch.query_start, batch.seq_lens, batch.block_table, scale)


@pytest.fixture
def cuda_path_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CPU kernels off (torch's ops, as on CUDA) and the Triton attention kernels stubbed."""
    was_enabled = cpu_kernels._settings.enabled
    cpu_kernels.configure(enabled=False)
    monkeypatch.setattr(triton_attention, "paged_decode_attention", _stub_decode)
    monkeypatch.setattr(triton_varlen_attention, "paged_varlen_attention", _stub_varlen)
    yield
    cpu_kernels.configure(enabled=was_enabled)


def _runner(model_dir: Path, explicit: bool, dtype: torch.dtype = torch.bfloat16) -> ModelRunner:
    """``explicit``: the CUDA path (explicit transfers, the fused GPU layer ops); else the
    ordinary CPU path (eager torch layers) as the reference."""
    runner = ModelRunner(ResolvedModel(model_dir, "tiny"), dtype, CPU, explicit_transfers=explicit)
    if explicit:
        runner.model.use_fused_gpu_ops(MAX_POSITIONS)
    runner.initialize_kv_cache(NUM_BLOCKS + 1, BLOCK_SIZE)
    runner.warmup()
    runner._graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        BUCKETS,
        width=4,
        block_size=BLOCK_SIZE,
        scratch_block=NUM_BLOCKS,
        device=CPU,
        use_triton_decode=True,
    )
    # Slots allocated up front, as a runner with graphs has them, read by the sampled tail.
    vocab = runner.config.vocab_size
    runner._table, runner._penalties = sampling_state(vocab, CPU, runner.io, graphs=True)
    runner._graphs.bind_sampling(runner._table, runner._penalties)
    return runner


class _Stream:
    """``num_rows`` requests of 3-token prompts, one block each, stepped by hand."""

    def __init__(self, runner: ModelRunner, num_rows: int, params: SamplingParams) -> None:
        self.runner = runner
        self.prompts = [(1 + i % 50, 2 + i % 7, 3 + i % 11) for i in range(num_rows)]
        news = tuple(
            NewRequestData(f"r{i}", p, len(p), 0, params) for i, p in enumerate(self.prompts)
        )
        chunks = tuple(
            ScheduledChunk(f"r{i}", p, 0, (i,), True) for i, p in enumerate(self.prompts)
        )
        self.step_id = 0
        self.tokens: list[list[int]] = [[] for _ in self.prompts]
        self._record(runner.execute_model(SchedulerOutput(0, chunks, new_requests=news)))

    def _record(self, out: RunnerOutput) -> None:
        for s in out.sampled:
            self.tokens[int(s.req_id[1:])].append(s.token_id)

    def decode(self, grammar: tuple[torch.Tensor, tuple[str, ...]] | None = None) -> None:
        """One decode step of every request (``grammar``: the step's bitmask and the
        requests it constrains)."""
        self.step_id += 1
        chunks = tuple(
            ScheduledChunk(
                f"r{i}", (self.tokens[i][-1],), len(p) + len(self.tokens[i]) - 1, (i,), True
            )
            for i, p in enumerate(self.prompts)
        )
        bitmask, constrained = grammar if grammar is not None else (None, ())
        step = SchedulerOutput(
            self.step_id, chunks, grammar_bitmask=bitmask, grammar_req_ids=constrained
        )
        self._record(self.runner.execute_model(step))


@pytest.mark.usefixtures("cuda_path_on_cpu")
@pytest.mark.parametrize("num_rows", [1, 64])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_decode_step_reads_back_once_and_never_waits_otherwise(
    tiny_model_factory: TinyModelFactory, num_rows: int, kind: str
) -> None:
    model_dir = tiny_model_factory("llama", seed=3)
    params = GREEDY if kind == "greedy" else SAMPLED
    runner = _runner(model_dir, explicit=True)
    graphs = runner._graphs
    assert graphs is not None
    stream = _Stream(runner, num_rows, params)
    stream.decode()  # first decode: one-time allocations (the readback buffer)
    runs = graphs.num_runs
    layer = runner.model._layers[1]  # a layer whose residual stream comes in unsummed
    with SyncAudit(layer=layer, graphs=graphs) as audit:
        stream.decode()
    counts = audit.counts
    assert graphs.num_runs == runs + 1  # the step was served from the graph buffers
    problems = {k: v for k, v in counts.details.items() if not k.startswith("kernel:")}
    assert counts.h2d_blocking == 0, problems
    assert counts.d2h == 1, problems
    assert counts.syncs == 0, problems
    assert counts.implicit == 0, problems
    assert 0 < counts.layer_kernels <= MAX_LAYER_KERNELS, counts.summary()
    # The final norm and the LM head run in the bucket's graph; a greedy step's argmax and
    # logprob in its greedy tail, a sampled step's penalties, filters, seeded draw, top-n
    # and count updates in its sampled tail: after the replay, only the one copy back (plus,
    # before it, the two input uploads).
    outside = {k: v for k, v in counts.details.items() if k.startswith("outside_graph:")}
    assert outside == {"outside_graph:aten.copy_": counts.h2d + counts.d2h}, outside
    assert counts.h2d == 2, counts.summary()
    assert counts.kernels - counts.graph_kernels == 3, counts.summary()
    assert all(len(t) == 3 for t in stream.tokens)

    # The explicit-transfer, sync-free path samples exactly what the CPU path samples.
    plain = _Stream(_runner(model_dir, explicit=False), num_rows, params)
    plain.decode()
    plain.decode()
    assert stream.tokens == plain.tokens


def _mixed_step(runner: ModelRunner, stream: _Stream, params: SamplingParams) -> SchedulerOutput:
    """The stream's decode rows, two fresh prompts and a chunk continuing a prompt whose
    first 8 tokens were prefilled in a step before (run here): issue #29's mixed step."""
    n = len(stream.prompts)
    prompts = {f"r{n}": tuple(range(5, 15)), f"r{n + 1}": tuple(range(7, 13))}
    long_prompt = tuple(range(20, 34))
    first = ScheduledChunk(f"r{n + 2}", long_prompt[:8], 0, (n + 2,), False)
    new_long = NewRequestData(f"r{n + 2}", long_prompt, len(long_prompt), 0, params)
    runner.execute_model(SchedulerOutput(100, (first,), new_requests=(new_long,)))
    decodes = [
        ScheduledChunk(f"r{i}", (stream.tokens[i][-1],), len(p) + len(stream.tokens[i]) - 1,
                       (i,), True)
        for i, p in enumerate(stream.prompts)
    ]  # fmt: skip
    fresh = [ScheduledChunk(r, p, 0, (n + j,), True) for j, (r, p) in enumerate(prompts.items())]
    rest = ScheduledChunk(f"r{n + 2}", long_prompt[8:], 8, (n + 2,), True)
    news = tuple(NewRequestData(r, p, len(p), 0, params) for r, p in prompts.items())
    return SchedulerOutput(101, (*decodes, *fresh, rest), new_requests=news)


@pytest.mark.usefixtures("cuda_path_on_cpu")
@pytest.mark.parametrize("prefill", ["triton", "sdpa", "sdpa-pinned"])
def test_mixed_step_reads_back_once_and_never_waits_otherwise(
    tiny_model_factory: TinyModelFactory, prefill: PrefillAttention
) -> None:
    """A step with 64 decode rows, two fresh prompts and a continuing chunk (eager, not a
    graph) through each ``--gpu-prefill-attention`` path: its metadata goes up in
    non-blocking copies, nothing is read back but the sampled tokens; through the Triton
    kernel a layer is the decode step's nine launches.  The tokens equal the CPU path's
    (float32 here: in bfloat16 the stubbed kernels' float32 softmax and the CPU path's
    bfloat16 products part on near-ties of the random tiny model)."""
    model_dir = tiny_model_factory("llama", seed=3)
    tokens = []
    for explicit in (True, False):
        runner = _runner(model_dir, explicit=explicit, dtype=torch.float32)
        if explicit:  # the backend a CUDA runner resolves for the flag (CPU resolves "sdpa")
            runner.backend = TorchPagedAttention(
                CPU, use_triton_decode=True, batch_prompts=True, prefill=prefill,
                upload=runner.io.upload_tensor,
            )  # fmt: skip
        stream = _Stream(runner, 64, GREEDY)
        stream.decode()
        step = _mixed_step(runner, stream, GREEDY)
        if not explicit:
            tokens.append([s.token_id for s in runner.execute_model(step).sampled])
            continue
        layer = runner.model._layers[1]
        with SyncAudit(layer=layer) as audit:
            out = runner.execute_model(step)
        tokens.append([s.token_id for s in out.sampled])
        counts = audit.counts
        problems = {k: v for k, v in counts.details.items() if not k.startswith("kernel:")}
        assert counts.h2d > 0 and counts.h2d_blocking == 0, problems
        assert counts.d2h == 1, problems
        assert counts.syncs == 0, problems
        assert counts.implicit == 0, problems
        if prefill == "triton":
            assert counts.layer_kernels <= MAX_LAYER_KERNELS, counts.summary()
    assert len(tokens[0]) == 64 + 3
    assert tokens[0] == tokens[1]


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_decode_step_on_cuda_has_no_synchronising_call(
    tiny_model_factory: TinyModelFactory, kind: str
) -> None:
    """On a GPU: the captured decode step, sampled and read back, under sync debug "error"
    (the one readback waits on an event, which the debug mode does not count)."""
    model_dir = tiny_model_factory("llama", seed=3)
    device = torch.device("cuda")
    runner = ModelRunner(ResolvedModel(model_dir, "tiny"), torch.bfloat16, device)
    runner.enable_cuda_graphs(BUCKETS, 4 * BLOCK_SIZE, BLOCK_SIZE)
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    stream = _Stream(runner, 64, GREEDY if kind == "greedy" else SAMPLED)
    stream.decode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stream.decode()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    runner.shutdown()


@pytest.mark.usefixtures("cuda_path_on_cpu")
def test_sampled_tail_gives_the_same_tokens_with_overlap_on_and_off(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded sampling in the graphs' sampled tail, with the next step's tokens as
    placeholders (overlapped scheduling) or known: the same tokens, every step served by
    the tail; and the same as the eager sync-free sampler over the same logits."""
    model_dir = tiny_model_factory("llama", seed=3)

    def tokens(placeholders: bool, tail: bool) -> list[list[int]]:
        runner = _runner(model_dir, explicit=True)
        graphs = runner._graphs
        assert graphs is not None
        served: list[bool] = []
        sampled = graphs.sampled

        def spy(*args: object, **kwargs: object) -> torch.Tensor | None:
            out = sampled(*args, **kwargs)  # type: ignore[arg-type]
            served.append(out is not None)
            return out

        monkeypatch.setattr(graphs, "sampled", spy)
        stream = PlaceholderStream(runner, 8, SAMPLED)
        for _ in range(3):
            stream.decode(placeholders)
        assert served == ([True] * 3 if tail else [])
        return stream.tokens

    known = tokens(placeholders=False, tail=True)
    assert tokens(placeholders=True, tail=True) == known
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "graph_sample", lambda *args, **kwargs: None)
        assert tokens(placeholders=True, tail=False) == known


def _bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """xgrammar's packed int32 layout of bool ``[rows, vocab]``: bit ``j % 32`` of word
    ``j // 32`` for token ``j``."""
    rows, vocab = allowed.shape
    bits = torch.nn.functional.pad(allowed, (0, -vocab % 32)).view(rows, -1, 32).long()
    packed = (bits << torch.arange(32)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


@pytest.mark.usefixtures("cuda_path_on_cpu")
def test_a_constrained_step_samples_in_the_graph(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step with grammar-constrained rows: their bitmask goes to the device in one
    more asynchronous copy and is applied in the sampled tail (nothing else outside the
    graphs), the constrained rows keep to it, and the tokens equal the eager sampler's."""
    model_dir = tiny_model_factory("llama", seed=3)
    constrained = ("r0", "r2", "r5")

    def run(tail: bool) -> tuple[list[list[int]], AuditCounts]:
        runner = _runner(model_dir, explicit=True)
        stream = _Stream(runner, 8, SAMPLED)
        stream.decode()
        allowed = torch.zeros(len(constrained), runner.config.vocab_size, dtype=torch.bool)
        allowed[:, 100:120] = True
        bitmask = _bitmask(allowed)  # the engine's, made before the step: host memory
        with SyncAudit(host_tensors=[bitmask], graphs=runner._graphs) as audit:
            stream.decode((bitmask, constrained))
        return stream.tokens, audit.counts

    tokens, counts = run(tail=True)
    outside = {k: v for k, v in counts.details.items() if k.startswith("outside_graph:")}
    assert outside == {"outside_graph:aten.copy_": 4}, outside
    summary = (counts.h2d, counts.h2d_blocking, counts.d2h, counts.syncs, counts.implicit)
    assert summary == (3, 0, 1, 0, 0), counts.details
    assert all(100 <= tokens[int(r[1:])][-1] < 120 for r in constrained)
    with monkeypatch.context() as patch:
        patch.setattr(model_runner, "graph_sample", lambda *args, **kwargs: None)
        eager, _ = run(tail=False)
    assert tokens == eager


def _cuda_runner(model_dir: Path) -> ModelRunner:
    runner = ModelRunner(ResolvedModel(model_dir, "tiny"), torch.bfloat16, torch.device("cuda"))
    runner.enable_cuda_graphs(BUCKETS, 4 * BLOCK_SIZE, BLOCK_SIZE)
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    assert runner.cuda_graph_sizes == BUCKETS, "capture failed: see the warning logged"
    return runner


@pytest.mark.cuda
def test_sampled_step_in_the_graph_equals_eager_sampling_on_cuda(
    tiny_model_factory: TinyModelFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU: 64 seeded, penalised, filtered rows sampled by the captured sampled tail,
    every decode step under sync debug "error", give the tokens the eager sync-free sampler
    gives from the same graph's logits (the graphs' forward is the same in both runs)."""
    model_dir = tiny_model_factory("llama", seed=3)
    runner = _cuda_runner(model_dir)
    graphs = runner._graphs
    assert graphs is not None
    served: list[bool] = []
    sampled = graphs.sampled

    def spy(*args: object, **kwargs: object) -> torch.Tensor | None:
        out = sampled(*args, **kwargs)  # type: ignore[arg-type]
        served.append(out is not None)
        return out

    monkeypatch.setattr(graphs, "sampled", spy)
    in_graph = _Stream(runner, 64, SAMPLED)
    in_graph.decode()  # first decode: one-time allocations (the pinned readback buffer)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            in_graph.decode()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    runner.shutdown()
    assert served == [True] * 4

    monkeypatch.setattr(model_runner, "graph_sample", lambda *args, **kwargs: None)
    eager_runner = _cuda_runner(model_dir)
    eager = _Stream(eager_runner, 64, SAMPLED)
    for _ in range(4):
        eager.decode()
    eager_runner.shutdown()
    assert in_graph.tokens == eager.tokens


_DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.usefixtures("cuda_path_on_cpu")
@pytest.mark.parametrize("arch", ["phi3", "llama-dynamic"])
def test_length_dependent_rotary_decode_step_never_waits(
    tiny_model_factory: TinyModelFactory, arch: str
) -> None:
    """Phi-3's longrope picks short or long factors from each sequence's length on the
    device: a value read there (``bool(long.any())``) invalidated every CUDA graph capture of
    Phi-3 models on an H200 (session 13), so they ran eagerly.  Dynamic NTK scales by the
    lengths on the device too."""
    if arch == "phi3":
        model_dir = tiny_model_factory("phi3", seed=3)
    else:
        model_dir = tiny_model_factory(
            "llama", seed=3, max_position_embeddings=64, rope_parameters=_DYNAMIC
        )
    runner = _runner(model_dir, explicit=True)
    assert runner.model._gpu_tables == [None]  # angles computed per step, from lengths
    stream = _Stream(runner, 4, GREEDY)
    stream.decode()
    with SyncAudit(layer=runner.model._layers[1], graphs=runner._graphs) as audit:
        stream.decode()
    problems = {k: v for k, v in audit.counts.details.items() if not k.startswith("kernel:")}
    assert audit.counts.syncs == 0, problems
    assert audit.counts.implicit == 0, problems
