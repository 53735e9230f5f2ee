"""Issue #15 logits controls against transformers' own processors on random logits:
min_p (MinPLogitsWarper), min_new_tokens (MinNewTokensLengthLogitsProcessor), logit_bias
(SequenceBiasLogitsProcessor with one-token sequences), and through the whole sampler:
neutral rows untouched, seeded draws independent of the batch."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from genserve.step import SamplingParams
from genserve.worker.logits_processors import apply_logit_controls, min_p_filter
from genserve.worker.sampler import Sampler, SamplingRow

VOCAB = 1000
CPU = torch.device("cpu")


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, -inf included (allclose treats -inf == -inf as equal with equal_nan off)."""
    return bool(torch.equal(torch.isinf(a), torch.isinf(b))) and torch.allclose(
        a[~torch.isinf(a)], b[~torch.isinf(b)], atol=1e-6
    )


@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.2, 0.9, 1.0])
def test_min_p_matches_transformers(min_p: float) -> None:
    x = logits(4, seed=1)
    expected = MinPLogitsWarper(min_p)(torch.zeros(4, 1, dtype=torch.long), x.clone())
    assert same(min_p_filter(x, [min_p] * 4), expected)


def test_min_p_per_row_and_zero_rows_untouched() -> None:
    x = logits(3, seed=2)
    out = min_p_filter(x, [0.0, 0.1, 0.0])
    assert torch.equal(out[0], x[0]) and torch.equal(out[2], x[2])
    expected = MinPLogitsWarper(0.1)(torch.zeros(1, 1, dtype=torch.long), x[1:2].clone())
    assert same(out[1:2], expected)


def test_min_p_in_the_sampler_follows_transformers_order() -> None:
    """temperature → top-k → top-p → min-p, as transformers' generate() orders its warpers:
    every sampled token is allowed by the transformers chain."""
    x = logits(1, seed=3) / 3
    chain = [TemperatureLogitsWarper(0.8), TopKLogitsWarper(50), TopPLogitsWarper(0.9)]
    expected = x.clone()
    for warper in chain:
        expected = warper(torch.zeros(1, 1, dtype=torch.long), expected)
    without_min_p = set(torch.isfinite(expected[0]).nonzero()[:, 0].tolist())
    expected = MinPLogitsWarper(0.2)(torch.zeros(1, 1, dtype=torch.long), expected)
    allowed = set(torch.isfinite(expected[0]).nonzero()[:, 0].tolist())
    assert 1 < len(allowed) < len(without_min_p)  # min_p cuts something here
    seen = set()
    for index in range(200):
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.2, seed=5)
        seen.add(Sampler(CPU)(x, [SamplingRow(params, index)]).token_ids[0])
    assert seen <= allowed
    assert len(seen) > 1  # it did sample, not collapse to greedy


@pytest.mark.parametrize("generated", [0, 2, 3, 7])
def test_min_new_tokens_matches_transformers(generated: int) -> None:
    prompt_len, min_new, eos = 5, 3, [7, 11]
    x = logits(1, seed=4)
    ids = torch.zeros(1, prompt_len + generated, dtype=torch.long)
    expected = MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos)(ids, x.clone())
    params = SamplingParams(min_new_tokens=min_new, min_tokens_banned_ids=(7, 11))
    assert same(apply_logit_controls(x, [params], [generated]), expected)


def test_min_new_tokens_bans_stop_ids_and_greedy_never_picks_them() -> None:
    x = torch.zeros(2, VOCAB)
    x[:, 42] = 10.0  # the model's favourite is a stop id
    x[:, 9] = 5.0
    params = SamplingParams(min_new_tokens=2, min_tokens_banned_ids=(42,))
    rows = [SamplingRow(params, 1), SamplingRow(params, 2)]
    out = Sampler(CPU)(x, rows)
    assert out.token_ids == [9, 42]  # banned below 2 generated tokens, free from then on
    # Reported logprobs stay the model's own.
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(x[0], -1)[9].item())


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    x = logits(1, seed=5)
    bias = {3: 5.0, 17: -100.0, 999: 0.5}
    processor = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    expected = processor(torch.zeros(1, 4, dtype=torch.long), x.clone())
    params = SamplingParams(logit_bias=tuple(bias.items()))
    assert torch.allclose(apply_logit_controls(x, [params], [0]), expected, atol=1e-6)


def test_logit_bias_steers_greedy_and_leaves_other_rows_alone() -> None:
    x = logits(3, seed=6)
    target = int(x[1].argmin())
    rows = [
        SamplingRow(SamplingParams(), 0),
        SamplingRow(SamplingParams(logit_bias=((target, 100.0),)), 0),
        SamplingRow(SamplingParams(), 0),
    ]
    out = Sampler(CPU)(x, rows)
    assert out.token_ids == [int(x[0].argmax()), target, int(x[2].argmax())]
    controlled = apply_logit_controls(x, [r.params for r in rows], [0, 0, 0])
    assert torch.equal(controlled[0], x[0]) and torch.equal(controlled[2], x[2])


def test_neutral_batch_is_returned_as_is() -> None:
    x = logits(2, seed=7)
    assert apply_logit_controls(x, [SamplingParams(), SamplingParams()], [0, 5]) is x


def test_bias_then_repetition_penalty_as_vllm_orders_them() -> None:
    """logit_bias is added before the repetition penalty (vLLM's order)."""
    x = torch.zeros(1, VOCAB)
    x[0, 5] = 1.0
    counts = torch.zeros(VOCAB)
    counts[5] = 1
    params = SamplingParams(repetition_penalty=2.0, logit_bias=((5, -3.0),))
    out = Sampler(CPU)(x, [SamplingRow(params, 0, 1, counts)])
    # (1 - 3) * 2 = -4 < 0 for token 5: the argmax moves to token 0 (score 0).
    assert out.token_ids == [0]


def test_seeded_min_p_row_is_independent_of_the_batch() -> None:
    x = logits(4, seed=8)
    target = SamplingParams(temperature=1.0, min_p=0.05, seed=1234, logit_bias=((1, 2.0),))
    alone = [Sampler(CPU)(x[2:3], [SamplingRow(target, i)]).token_ids[0] for i in range(20)]
    busy = []
    for i in range(20):
        rows = [
            SamplingRow(SamplingParams(temperature=0.7, top_k=5, seed=9), i),
            SamplingRow(SamplingParams(min_new_tokens=5, min_tokens_banned_ids=(3,)), i),
            SamplingRow(target, i),
            SamplingRow(SamplingParams(min_p=0.3, temperature=1.2, seed=4), i),
        ]
        busy.append(Sampler(CPU)(x, rows).token_ids[2])
    assert alone == busy
