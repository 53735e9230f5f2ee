"""The sampler: seeded draws independent of the batch, filters equal to transformers'
warpers, penalties with HF/TGI semantics, raw-distribution logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from genserve.step import SamplingParams
from genserve.worker.sampler import Sampler, SamplingRow, row_seed
from genserve.worker.sampling_filters import (
    top_k_filter as _top_k,
)
from genserve.worker.sampling_filters import (
    top_p_filter as _top_p,
)
from genserve.worker.sampling_filters import (
    top_p_sorted as _top_p_sorted,
)
from genserve.worker.sampling_filters import (
    typical_p_filter as _typical_p,
)

VOCAB = 1000
CPU = torch.device("cpu")


def logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def row(**kw: object) -> SamplingRow:
    index = int(kw.pop("output_index", 0))  # type: ignore[call-overload]
    return SamplingRow(SamplingParams(**kw), output_index=index)  # type: ignore[arg-type]


def test_greedy_is_argmax_and_logprob_is_raw() -> None:
    x = logits(3)
    out = Sampler(CPU)(x, [row(), row(), row()])
    assert out.token_ids == x.argmax(-1).tolist()
    expected = torch.log_softmax(x, -1)[torch.arange(3), x.argmax(-1)]
    assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-6)


def test_seeded_draw_ignores_the_rest_of_the_batch() -> None:
    x = logits(4, seed=1)
    target = dict(temperature=0.9, top_k=40, top_p=0.9, seed=42, output_index=5)
    alone = Sampler(CPU)(x[2:3], [row(**target)])
    busy = Sampler(CPU)(
        x,
        [
            row(temperature=1.3, seed=7),
            row(),
            row(**target),
            row(temperature=0.5, typical_p=0.5, seed=42, output_index=6),
        ],
    )
    assert busy.token_ids[2] == alone.token_ids[0]
    assert busy.logprobs[2] == pytest.approx(alone.logprobs[0])


def test_draws_vary_with_position_and_seed() -> None:
    x = torch.zeros(1, VOCAB)  # uniform: every draw equally likely
    s = Sampler(CPU)
    by_position = {
        s(x, [row(temperature=1.0, seed=3, output_index=i)]).token_ids[0] for i in range(20)
    }
    by_seed = {s(x, [row(temperature=1.0, seed=i)]).token_ids[0] for i in range(20)}
    assert len(by_position) > 15 and len(by_seed) > 15
    assert row_seed(1, 0) != row_seed(0, 1) and 0 <= row_seed(2**63, 2**40) < 2**63


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log()[None]
    s = Sampler(CPU)
    n = 4000
    counts = torch.zeros(4)
    for i in range(n):
        counts[s(x, [row(temperature=1.0, seed=i)]).token_ids[0]] += 1
    # Binomial standard deviation is at most sqrt(n)/2 = 32: allow 4 of them.
    assert (counts - probs * n).abs().max() < 4 * math.sqrt(n) / 2


@pytest.mark.parametrize("k", [0, 1, 5, 50])
def test_top_k_matches_transformers(k: int) -> None:
    x = logits(1, seed=2)
    ours = _top_k(x.clone(), [k])
    ref = x.clone() if k == 0 else TopKLogitsWarper(k)(None, x.clone())
    assert torch.equal(ours.isinf(), ref.isinf())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_matches_transformers(p: float) -> None:
    x = logits(2, seed=3)
    ours = _top_p(x.clone(), [p, 1.0])
    ref = TopPLogitsWarper(p)(None, x[:1].clone())
    assert torch.equal(ours[:1].isinf(), ref.isinf())
    assert not ours[1].isinf().any()  # top_p == 1: untouched row in the same batch


@pytest.mark.parametrize("scale", [8.0, 1.0, 0.05])
def test_top_p_candidate_path_equals_full_sort(scale: float) -> None:
    """Peaked rows take the top-k shortcut, flat ones (scale 0.05) fall back to sorting;
    either way the kept set is HF's."""
    x = torch.randn(6, 5000, generator=torch.Generator().manual_seed(9)) * scale
    ps = [0.3, 0.9, 0.99, 1.0, 0.5, 0.95]
    ours = _top_p(x.clone(), ps)
    assert torch.equal(ours.isinf(), _top_p_sorted(x.clone(), ps).isinf())
    for i, p in enumerate(ps):
        ref = x[i : i + 1].clone() if p == 1.0 else TopPLogitsWarper(p)(None, x[i : i + 1].clone())
        assert torch.equal(ours[i : i + 1].isinf(), ref.isinf()), (scale, p)


def test_top_p_after_top_k_keeps_only_allowed_tokens() -> None:
    x = logits(3, seed=8, vocab=5000)
    filtered = _top_p(_top_k(x.clone(), [5, 40, 0]), [0.9, 0.99, 0.9])
    assert (~filtered[0].isinf()).sum() <= 5 and (~filtered[1].isinf()).sum() <= 40
    assert torch.equal(
        filtered.isinf(), _top_p_sorted(_top_k(x.clone(), [5, 40, 0]), [0.9, 0.99, 0.9]).isinf()
    )


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.95])
def test_typical_p_matches_transformers(mass: float) -> None:
    x = logits(2, seed=4)
    ours = _typical_p(x.clone(), [mass, 1.0])
    ref = TypicalLogitsWarper(mass)(None, x[:1].clone())
    assert torch.equal(ours[:1].isinf(), ref.isinf())
    assert not ours[1].isinf().any()


def test_sampled_tokens_respect_filters() -> None:
    x = logits(1, seed=5)
    allowed = set(x[0].topk(3).indices.tolist())
    s = Sampler(CPU)
    drawn = {s(x, [row(temperature=2.0, top_k=3, seed=i)]).token_ids[0] for i in range(200)}
    assert drawn <= allowed and len(drawn) == 3


def penalised_row(
    prev: list[int], repetition: float = 1.0, frequency: float = 0.0, **kw: object
) -> SamplingRow:
    counts = torch.bincount(torch.tensor(prev), minlength=VOCAB).float()
    params = SamplingParams(repetition_penalty=repetition, frequency_penalty=frequency, **kw)  # type: ignore[arg-type]
    return SamplingRow(params, output_index=0, num_tokens=len(prev), token_counts=counts)


def test_repetition_penalty_matches_transformers() -> None:
    x = logits(1, seed=6)
    prev = x[0].topk(4).indices.tolist() + x[0].topk(3, largest=False).indices.tolist()
    processed = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([prev]), x.clone())
    out = Sampler(CPU)(x, [penalised_row(prev, repetition=1.8)])
    assert out.token_ids[0] == processed.argmax(-1).item()
    assert out.token_ids[0] != x.argmax(-1).item()  # the penalty changed the greedy choice
    # The reported logprob is still the raw model's.
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(x, -1)[0, out.token_ids[0]].item())


def test_frequency_penalty_tgi_semantics() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 10], x[0, 20] = 1.0, 0.9
    # score -= penalty * count / num_tokens: with 0.4, token 10 (3 of 4 tokens) drops to
    # 0.7 and token 20 (1 of 4) to 0.8; with 0.1 they are 0.925 and 0.875.
    prev = [10, 10, 10, 20]
    assert Sampler(CPU)(x, [penalised_row(prev, frequency=0.4)]).token_ids == [20]
    assert Sampler(CPU)(x, [penalised_row(prev, frequency=0.1)]).token_ids == [10]


def test_top_tokens_are_raw_and_per_row() -> None:
    x = logits(2, seed=7)
    out = Sampler(CPU)(x, [row(num_top_tokens=3, temperature=0.5, seed=1), row()])
    lp = torch.log_softmax(x, -1)
    top = lp[0].topk(3)
    assert [t.token_id for t in out.top_tokens[0]] == top.indices.tolist()
    assert [t.logprob for t in out.top_tokens[0]] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert out.top_tokens[1] == ()


def test_first_argmax_equals_argmax_with_ties() -> None:
    from genserve.worker.sampler import first_argmax

    x = torch.randn(5, 8192, generator=torch.Generator().manual_seed(8))
    x[0, 100] = x[0, 5000] = 50.0  # a tie across chunks: the first index wins
    x[1, 2048] = x[1, 2049] = 50.0  # a tie inside a chunk
    x[2, -1] = 50.0
    assert torch.equal(first_argmax(x), x.argmax(-1))
    odd = torch.randn(3, 1000)  # vocabulary not a multiple of the chunk: plain argmax
    assert torch.equal(first_argmax(odd), odd.argmax(-1))


def test_extreme_uniform_draws_stay_on_allowed_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """u = 0 takes the first allowed token, u just below 1 the last one, even when the
    float32 running sum rounds the target onto the end of the vocabulary."""
    import genserve.worker.sampler as sampler_module

    x = logits(1, seed=10)
    allowed = sorted(x[0].topk(4).indices.tolist())
    for u, expected in ((0.0, allowed[0]), (1.0 - 2.0**-53, allowed[-1])):
        monkeypatch.setattr(sampler_module, "row_uniform", lambda seed, index, u=u: u)
        out = Sampler(CPU)(x, [row(temperature=1.0, top_k=4, seed=1)])
        assert out.token_ids == [expected]


def presence_row(
    prompt: list[int], output: list[int], presence: float, **kw: object
) -> SamplingRow:
    """A row as the runner builds it: counts over prompt + output, and over the output only."""
    counts = torch.bincount(torch.tensor(prompt + output), minlength=VOCAB).float()
    out_counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    params = SamplingParams(presence_penalty=presence, **kw)  # type: ignore[arg-type]
    return SamplingRow(
        params,
        output_index=len(output),
        num_tokens=len(prompt) + len(output),
        token_counts=counts,
        output_counts=out_counts,
    )


def reference_presence(scores: torch.Tensor, output: list[int], presence: float) -> torch.Tensor:
    """vLLM's documented semantics, written out: every token id that occurs in the generated
    output loses ``presence`` once, however often it occurred; prompt tokens are untouched."""
    expected = scores.clone()
    for token_id in set(output):
        expected[token_id] -= presence
    return expected


@pytest.mark.parametrize("presence", [1.5, -1.0, 2.0, -2.0])
def test_presence_penalty_matches_reference(presence: float) -> None:
    x = logits(1, seed=11)
    top = x[0].topk(6).indices.tolist()
    prompt = [top[0], top[0], top[5]]  # in the prompt only: not penalised
    output = [top[1], top[1], top[1], top[2]]  # token 1 three times, token 2 once
    out = Sampler(CPU)(x, [presence_row(prompt, output, presence, num_top_tokens=0)])
    expected = reference_presence(x[0], output, presence)
    assert out.token_ids == [int(expected.argmax())]
    # Compare the whole penalised distribution through the sampler's own step.
    penalised = Sampler(CPU)._apply_penalties(x.clone(), [presence_row(prompt, output, presence)])
    assert torch.allclose(penalised[0], expected, atol=1e-6)
    # Logprobs stay the raw model's.
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(x, -1)[0, out.token_ids[0]].item())


def test_presence_penalty_counts_distinct_output_tokens_once() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 10], x[0, 20] = 1.0, 0.5
    # Token 10 generated five times loses 0.6 once (presence, not frequency): 0.4 < 0.5.
    assert Sampler(CPU)(x, [presence_row([], [10] * 5, presence=0.6)]).token_ids == [20]
    # ... and 0.4 once is still more than 0.45 for a penalty of 0.45 with any count.
    assert Sampler(CPU)(x, [presence_row([], [10] * 5, presence=0.45)]).token_ids == [10]


def test_presence_penalty_ignores_prompt_tokens() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 10], x[0, 30], x[0, 20] = 1.0, 0.9, 0.8
    # 30 occurs only in the prompt and keeps 0.9; 10 was generated and drops to 0.45.  Over
    # prompt + output (not the OpenAI semantics) 30 would drop to 0.35 and 20 would win.
    assert Sampler(CPU)(x, [presence_row([30, 30], [10], presence=0.55)]).token_ids == [30]


def test_negative_frequency_penalty_favours_repeats() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 10], x[0, 20] = 0.9, 1.0
    # TGI semantics with a negative penalty: score += 0.4 * 2/4 for token 10 -> 1.1.
    assert Sampler(CPU)(x, [penalised_row([10, 10, 5, 6], frequency=-0.4)]).token_ids == [10]


def test_presence_penalty_in_a_mixed_batch() -> None:
    """Penalised and plain rows in one batch: only the penalised row changes."""
    x = logits(3, seed=12)
    greedy = x.argmax(-1).tolist()
    rows = [
        row(),
        presence_row([], [greedy[1]], 2.0),
        row(temperature=0.7, seed=3),
    ]
    out = Sampler(CPU)(x, rows)
    alone = Sampler(CPU)(x[2:], [row(temperature=0.7, seed=3)])
    assert out.token_ids[0] == greedy[0]
    expected = reference_presence(x[1], [greedy[1]], 2.0)
    assert out.token_ids[1] == int(expected.argmax())
    assert out.token_ids[2] == alone.token_ids[0]
