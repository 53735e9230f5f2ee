"""The model runner, driven directly with hand-built steps, against transformers on the same
float32 weights: greedy tokens identical, logprobs within 1e-4 (the e2e bar is 1e-3).

A small in-test driver plays the scheduler: token budget per step (so prompts are chunked
and decodes share steps with prefill chunks), block tables from a shuffled free list (so
blocks are never contiguous), shared prefix blocks, preemption with recomputation.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from genserve.model.loader import ResolvedModel
from genserve.step import (
    NewRequestData,
    SampledToken,
    SamplingParams,
    ScheduledChunk,
    SchedulerOutput,
)
from genserve.worker.model_runner import ModelRunner
from tests.conftest import TinyModelFactory

BLOCK_SIZE = 16
NUM_BLOCKS = 160


@dataclass
class _Req:
    req_id: str
    tokens: list[int]  # prompt + generated
    num_prompt: int
    max_new: int
    params: SamplingParams
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    shared_blocks: int = 0  # leading blocks borrowed from another request (never freed)
    sent: bool = False
    out: list[SampledToken] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.tokens) - self.num_prompt >= self.max_new


class Driver:
    """A minimal scheduler: per step, decodes first, then prefill chunks under a budget."""

    def __init__(self, runner: ModelRunner, budget: int, seed: int = 0) -> None:
        self.runner = runner
        self.budget = budget
        self.rng = random.Random(seed)
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.running: list[_Req] = []
        self.finished: list[str] = []
        self.step_id = 0
        self.prompt_logprobs: dict[str, list[tuple[int, float]]] = {}

    def add(
        self,
        req_id: str,
        prompt: list[int],
        max_new: int,
        params: SamplingParams | None = None,
        prefix_of: _Req | None = None,
        prefix_blocks: int = 0,
    ) -> _Req:
        req = _Req(req_id, list(prompt), len(prompt), max_new, params or SamplingParams())
        if prefix_of is not None:  # reuse computed blocks, as the prefix cache would
            req.blocks = prefix_of.blocks[:prefix_blocks]
            req.shared_blocks = prefix_blocks
            req.computed = prefix_blocks * BLOCK_SIZE
        self.running.append(req)
        return req

    def preempt(self, req: _Req) -> None:
        """Drop the request's KV and state; it is re-sent with everything generated so far."""
        self.free += req.blocks[req.shared_blocks :]
        req.blocks, req.shared_blocks, req.computed, req.sent = [], 0, 0, False
        self.finished.append(req.req_id)

    def step(self) -> None:
        chunks, new = [], []
        left = self.budget
        order = sorted(self.running, key=lambda r: r.computed < len(r.tokens) - 1)
        for req in order:
            todo = len(req.tokens) - req.computed
            n = min(todo, left)
            if n <= 0:
                continue
            left -= n
            end = req.computed + n
            while len(req.blocks) * BLOCK_SIZE < end:
                req.blocks.append(self.free.pop())
            if not req.sent:
                new.append(
                    NewRequestData(
                        req.req_id,
                        tuple(req.tokens),
                        req.num_prompt,
                        len(req.tokens) - req.num_prompt,
                        req.params,
                    )
                )
                req.sent = True
            chunk_tokens = tuple(req.tokens[req.computed : end])
            sample = end == len(req.tokens)
            chunks.append(
                ScheduledChunk(req.req_id, chunk_tokens, req.computed, tuple(req.blocks), sample)
            )
            req.computed = end
        out = self.runner.execute_model(
            SchedulerOutput(self.step_id, tuple(chunks), tuple(new), tuple(self.finished))
        )
        self.step_id += 1
        self.finished = []
        by_id = {r.req_id: r for r in self.running}
        for sampled in out.sampled:
            req = by_id[sampled.req_id]
            req.tokens.append(sampled.token_id)
            req.out.append(sampled)
        for pl in out.prompt_logprobs:
            got = self.prompt_logprobs.setdefault(pl.req_id, [])
            assert pl.first_pos == len(got) + 1
            got.extend((t.token_id, t.logprob) for t in pl.logprobs)
        for req in [r for r in self.running if r.done]:
            self.running.remove(req)
            self.free += req.blocks[req.shared_blocks :]
            self.finished.append(req.req_id)

    def run(self) -> None:
        while self.running:
            self.step()


_HF: dict[Path, Any] = {}


def hf_model(model_dir: Path) -> Any:
    if model_dir not in _HF:
        _HF[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return _HF[model_dir]


def hf_greedy(model_dir: Path, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    return hf_greedy_with(hf_model(model_dir), prompt, max_new)


def hf_greedy_with(model: Any, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for ``prompt`` with a loaded model."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        torch.log_softmax(step_logits[0].float(), -1)[t].item()
        for step_logits, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def make_runner(model_dir: Path) -> ModelRunner:
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cpu")
    )
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    return runner


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lengths]


def assert_matches_hf(model_dir: Path, req: _Req, max_new: int) -> None:
    expected_ids, expected_lps = hf_greedy(model_dir, req.tokens[: req.num_prompt], max_new)
    assert [s.token_id for s in req.out] == expected_ids, req.req_id
    assert [s.logprob for s in req.out] == pytest.approx(expected_lps, abs=1e-4), req.req_id


def test_mixed_batches_match_transformers(tiny_model_dir: Path) -> None:
    """Chunked prompts of varied lengths share steps with decodes; blocks are scattered."""
    runner = make_runner(tiny_model_dir)
    driver = Driver(runner, budget=48)
    prompts = random_prompts([3, 17, 40, 95, 130, 1], seed=1)
    reqs = [driver.add(f"r{i}", p, 12) for i, p in enumerate(prompts)]
    for _ in range(3):  # let the first ones start decoding, then add more mid-flight
        driver.step()
    late = [driver.add(f"late{i}", p, 10) for i, p in enumerate(random_prompts([33, 8], seed=2))]
    driver.run()
    for req in reqs:
        assert_matches_hf(tiny_model_dir, req, 12)
    for req in late:
        assert_matches_hf(tiny_model_dir, req, 10)
    assert sorted(driver.free) == list(range(NUM_BLOCKS))


def test_shared_prefix_blocks(tiny_model_factory: TinyModelFactory) -> None:
    """A request whose first blocks were computed by another request reads them from the
    cache (chunk starting mid-sequence) and still matches transformers."""
    model_dir = tiny_model_factory("llama")
    runner = make_runner(model_dir)
    driver = Driver(runner, budget=64)
    prefix = random_prompts([40], seed=3)[0]
    first = driver.add("first", [*prefix, 11, 12, 13], 6)
    driver.step()  # computes the 43-token prompt, including two full blocks
    second = driver.add(
        "second", [*prefix, 21, 22, 23, 24, 25], 6, prefix_of=first, prefix_blocks=2
    )
    # A decode-shaped chunk (1 token) after a cached prefix goes through the batched path.
    third = driver.add("third", [*prefix[:32], 7], 6, prefix_of=first, prefix_blocks=2)
    driver.run()
    for req in (first, second, third):
        assert_matches_hf(model_dir, req, 6)


def test_preemption_recompute_gives_same_tokens(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("qwen2")
    runner = make_runner(model_dir)
    driver = Driver(runner, budget=40)
    prompts = random_prompts([25, 50], seed=4)
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234)
    a = driver.add("a", prompts[0], 16)
    b = driver.add("b", prompts[1], 16, params=seeded)
    for _ in range(8):
        driver.step()
    assert 0 < len(a.out) < 16 and 0 < len(b.out) < 16
    driver.preempt(a)
    driver.preempt(b)
    driver.run()
    assert_matches_hf(model_dir, a, 16)

    alone = Driver(make_runner(model_dir), budget=1000)
    b_alone = alone.add("b", prompts[1], 16, params=seeded)
    alone.run()
    assert [s.token_id for s in b.out] == [s.token_id for s in b_alone.out]


def test_prompt_logprobs_across_chunks(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("mistral")
    runner = make_runner(model_dir)
    driver = Driver(runner, budget=20)
    prompt = random_prompts([57], seed=5)[0]
    driver.add("p", prompt, 2, params=SamplingParams(prompt_logprobs=True))
    driver.add("other", random_prompts([9], seed=6)[0], 3)
    driver.run()
    with torch.inference_mode():
        logits = hf_model(model_dir)(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[torch.arange(56), torch.tensor(prompt[1:])]
    got = driver.prompt_logprobs["p"]
    assert [t for t, _ in got] == prompt[1:]
    assert [lp for _, lp in got] == pytest.approx(expected.tolist(), abs=1e-4)
    assert "other" not in driver.prompt_logprobs


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},
    ],
    ids=["3-kv-heads", "rope-llama3", "rope-linear", "mha-biases"],
)
def test_llama_variants_match_transformers(
    tiny_model_factory: TinyModelFactory, overrides: dict[str, object]
) -> None:
    model_dir = tiny_model_factory("llama", seed=7, **overrides)
    runner = make_runner(model_dir)
    driver = Driver(runner, budget=64)
    reqs = [driver.add(f"r{i}", p, 8) for i, p in enumerate(random_prompts([5, 80], seed=8))]
    driver.run()
    for req in reqs:
        assert_matches_hf(model_dir, req, 8)


def test_top_tokens_and_step_contract(tiny_model_factory: TinyModelFactory) -> None:
    """Only chunks with sample=True produce tokens; top tokens are sorted raw logprobs."""
    model_dir = tiny_model_factory("llama")
    runner = make_runner(model_dir)
    prompt = random_prompts([20], seed=9)[0]
    new = NewRequestData("t", tuple(prompt), 20, 0, SamplingParams(num_top_tokens=3))
    first = ScheduledChunk("t", tuple(prompt[:16]), 0, (5,), sample=False)
    out = runner.execute_model(SchedulerOutput(0, (first,), (new,)))
    assert out.step_id == 0 and out.sampled == () and out.prompt_logprobs == ()
    rest = ScheduledChunk("t", tuple(prompt[16:]), 16, (5, 9), sample=True)
    (sampled,) = runner.execute_model(SchedulerOutput(1, (rest,))).sampled
    tops = sampled.top_tokens
    assert len(tops) == 3 and tops[0].token_id == sampled.token_id
    assert tops[0].logprob == pytest.approx(sampled.logprob)
    assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
    assert runner.execute_model(SchedulerOutput(2, (), finished_req_ids=("t",))).sampled == ()
    with pytest.raises(KeyError):
        runner.execute_model(SchedulerOutput(3, (ScheduledChunk("t", (1,), 20, (5, 9), True),)))


def test_kv_cache_sizing_and_clean_warmup(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("llama")
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.float32, torch.device("cpu")
    )
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    pool = [cache.data_ptr() for cache in runner.kv_caches]
    runner.warmup()
    assert len(runner.kv_caches) == 2
    assert all(not cache.any() for cache in runner.kv_caches)  # warmup left no trace
    # On CPU the pool the warm-up faulted in is kept (its used blocks zeroed), so the first
    # request does not fault the same pages in again.
    assert [cache.data_ptr() for cache in runner.kv_caches] == pool
    # 2 layers x (K + V) x 2 KV heads x head_dim 16 x 4 bytes per token.
    assert runner.kv_cache_bytes_per_block(16) == 2 * 2 * 2 * 16 * 4 * 16
    assert 0 < runner.available_kv_memory_bytes(0.5) < runner.available_kv_memory_bytes(1.0)
    runner.shutdown()
    runner.shutdown()


def test_presence_penalty_survives_preemption(tiny_model_factory: TinyModelFactory) -> None:
    """A readmitted request rebuilds its output-only counts from the tokens it brings back,
    so a presence-penalised sequence continues as if it had never been preempted."""
    model_dir = tiny_model_factory("llama")
    penalised = SamplingParams(presence_penalty=-2.0)  # negative: the tiny model repeats
    prompts = random_prompts([30], seed=5)
    driver = Driver(make_runner(model_dir), budget=64)
    req = driver.add("p", prompts[0], 20, params=penalised)
    for _ in range(8):
        driver.step()
    assert 0 < len(req.out) < 20
    driver.preempt(req)
    driver.run()
    alone = Driver(make_runner(model_dir), budget=1000)
    ref = alone.add("p", prompts[0], 20, params=penalised)
    alone.run()
    assert [s.token_id for s in req.out] == [s.token_id for s in ref.out]
    plain = Driver(make_runner(model_dir), budget=1000)
    unpenalised = plain.add("p", prompts[0], 20)
    plain.run()
    assert [s.token_id for s in ref.out] != [s.token_id for s in unpenalised.out]


def test_longrope_prompt_chunks_rotate_by_the_whole_prompt(
    tiny_model_factory: TinyModelFactory,
) -> None:
    """Phi-3's longrope (original context 128 in the tiny model): prompts of 130 and 200
    tokens prefilled in chunks of at most 48 rotate every chunk with the long factors, as
    transformers' one-forward prefill does (before, a chunk ending below 128 took the short
    ones); a 95-token prompt stays below and short."""
    model_dir = tiny_model_factory("phi3")
    driver = Driver(make_runner(model_dir), budget=48)
    prompts = random_prompts([130, 95, 200], seed=4)
    reqs = [driver.add(f"r{i}", p, 8) for i, p in enumerate(prompts)]
    driver.run()
    for req in reqs:
        assert_matches_hf(model_dir, req, 8)


@pytest.mark.parametrize("per_token", [False, True], ids=["chunks", "per-token"])
def test_prompt_rows_carry_the_whole_prompts_length(per_token: bool) -> None:
    """What length-dependent rotary reads (``sequence_lengths``): a decode row its context, a
    prompt chunk's rows the whole prompt (``SeqSpec.known_len``), a chunk that recomputes a
    preempted request's prompt (5 tokens) and outputs the prompt's length, then each output's
    own position + 1 (as when it was decoded), also when --deterministic attends each prompt
    token as a row of its own; a chunk with no known length its own end."""
    from genserve.model.attention import SeqSpec, TorchPagedAttention

    backend = TorchPagedAttention(
        torch.device("cpu"), use_cpu_kernel=per_token, per_token=per_token
    )
    seqs = [
        SeqSpec(1, 9, (0,)),
        SeqSpec(3, 0, (1,), known_len=130),
        SeqSpec(5, 3, (2,), known_len=5),
        SeqSpec(2, 4, (3,)),
    ]
    meta = backend.build(seqs, 1, BLOCK_SIZE)
    assert meta.sequence_lengths().tolist() == [10, 130, 130, 130, 5, 5, 6, 7, 8, 6, 6]
    assert [s.rotary_lens().tolist() for s in seqs[1:]] == [[130] * 3, [5, 5, 6, 7, 8], [6, 6]]


def test_the_served_scheduler_salts_by_rotary_regime(tiny_model_factory: TinyModelFactory) -> None:
    """The launcher hands the scheduler the model's length-dependent rotary (Phi-3's
    longrope with its original context), and nothing for position-only rotary."""
    from genserve.cli import _length_rotary
    from genserve.engine.rotary_salt import LengthRotary

    assert _length_rotary(make_runner(tiny_model_factory("phi3"))) == LengthRotary("longrope", 128)
    assert _length_rotary(make_runner(tiny_model_factory("llama"))) is None
