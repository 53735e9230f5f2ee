"""worker/watermark.py: TGI's green lists, the batched bias inside the sampler, detection."""

from __future__ import annotations

import random

import torch

from genserve.step import SamplingParams
from genserve.worker.sampler import Sampler, SamplingRow
from genserve.worker.watermark import HASH_KEY, apply_watermark, detect, greenlist_ids

VOCAB = 1000


def tgi_greenlist(prev_token: int, vocab: int, gamma: float) -> set[int]:
    """TGI's WatermarkLogitsProcessor._get_greenlist_ids, step by step."""
    rng = torch.Generator(device="cpu")
    rng.manual_seed(HASH_KEY * prev_token)
    return set(torch.randperm(vocab, generator=rng)[: int(vocab * gamma)].tolist())


def test_greenlist_is_tgis() -> None:
    for prev in (0, 1, 17, 999):
        ids = greenlist_ids(prev, VOCAB, 0.25, torch.device("cpu"))
        assert len(ids) == 250
        assert set(ids.tolist()) == tgi_greenlist(prev, VOCAB, 0.25)
    assert set(greenlist_ids(1, VOCAB, 0.5, torch.device("cpu")).tolist()) != set(
        greenlist_ids(2, VOCAB, 0.5, torch.device("cpu")).tolist()
    )


def test_bias_only_on_marked_rows_and_green_ids() -> None:
    scores = torch.randn(3, VOCAB)
    before = scores.clone()
    apply_watermark(scores, [0, 2], [5, 9], [0.5, 0.5], [2.0, 1.0])
    assert torch.equal(scores[1], before[1])
    for row, prev, delta in ((0, 5, 2.0), (2, 9, 1.0)):
        green = torch.zeros(VOCAB, dtype=torch.bool)
        green[list(tgi_greenlist(prev, VOCAB, 0.5))] = True
        assert torch.allclose(scores[row][green], before[row][green] + delta)
        assert torch.equal(scores[row][~green], before[row][~green])


def test_sampler_hook_watermarks_rows_that_ask() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.zeros(2, VOCAB)  # uniform: the bias alone decides
    marked = SamplingParams(temperature=0.0, watermark=True, watermark_delta=5.0)
    out = sampler(logits, [SamplingRow(marked, 0, prev_token=42), SamplingRow(SamplingParams(), 0)])
    assert out.token_ids[0] in tgi_greenlist(42, VOCAB, 0.5)  # greedy picks a green token
    assert out.token_ids[1] == 0  # untouched row: argmax of zeros
    # Reported logprobs stay the model's (unbiased) distribution.
    assert abs(out.logprobs[0] - (-torch.log(torch.tensor(float(VOCAB)))).item()) < 1e-5


def test_detect_z_scores() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(VOCAB) for _ in range(301)]
    assert abs(detect(tokens, VOCAB).z_score) < 3
    green = [7]
    for _ in range(200):
        green.append(rng.choice(sorted(tgi_greenlist(green[-1], VOCAB, 0.5))))
    found = detect(green, VOCAB)
    assert found.num_green == found.num_scored == 200
    assert found.z_score > 10
