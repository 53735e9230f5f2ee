"""genserve::greedy_stats (kernels/fused_cpu.cpp): each row's first argmax, maximum and
log-sum-exp in one C++ pass, which the sampler uses on CPU instead of a full log_softmax when no
top alternatives are asked for: same tokens as torch's argmax, log-probabilities within float32
rounding of log_softmax's, and torch's path wherever a row is not finite."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.step import SamplingParams
from genserve.worker.sampler import Sampler, SamplingRow

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 100, 32000, 49152, 49155])
def test_argmax_max_and_logsumexp_match_torch(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen) * 4
    argmax, peak, log_total = torch.ops.genserve.greedy_stats(logits)
    assert torch.equal(argmax, logits.argmax(dim=-1))
    assert torch.equal(peak, logits.amax(dim=-1))
    # torch's own float32 log_softmax is up to ~1e-5 off the float64 value at 49152 tokens
    # (measured 8.5e-6; the kernel's 4e-6): both within float32 rounding of a long sum.
    exact = torch.log_softmax(logits.double(), dim=-1).gather(1, argmax[:, None])[:, 0]
    chosen = (logits.gather(1, argmax[:, None])[:, 0] - peak) - log_total
    expected = torch.logsumexp(logits.double() - peak.double()[:, None], dim=-1)
    torch.testing.assert_close(log_total.double(), expected, rtol=0, atol=2e-5)
    torch.testing.assert_close(chosen.double(), exact, rtol=0, atol=2e-5)


def test_ties_go_to_the_first_index() -> None:
    vocab = 49155  # a tail past the last full vector
    logits = torch.zeros(6, vocab)
    for row, places in enumerate([(5, 3000), (3000, 5), (17, 1), (40000, 49154), (49154,), ()]):
        for place in places:
            logits[row, place] = 9.0
    argmax, _, _ = torch.ops.genserve.greedy_stats(logits)
    assert argmax.tolist() == [5, 5, 1, 40000, 49154, 0]
    assert torch.equal(argmax, logits.argmax(dim=-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_rows_that_are_not_finite_say_so(bad: float) -> None:
    logits = torch.randn(3, 100)
    logits[1, 42] = bad
    logits[2] = float("-inf")  # every token banned
    _, _, log_total = torch.ops.genserve.greedy_stats(logits)
    assert torch.isfinite(log_total[0])
    assert not torch.isfinite(log_total[1]) and not torch.isfinite(log_total[2])


def test_banned_tokens_add_nothing() -> None:
    logits = torch.randn(2, 1000)
    logits[:, 500:] = float("-inf")
    argmax, peak, log_total = torch.ops.genserve.greedy_stats(logits)
    expected = torch.logsumexp(logits[:, :500].double() - peak.double()[:, None], dim=-1)
    torch.testing.assert_close(log_total.double(), expected, rtol=0, atol=2e-6)
    assert (argmax < 500).all()


def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, output_index=3) for p in params]


def test_sampler_gives_the_same_tokens_and_logprobs_as_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=gen) * 3
    params = [SamplingParams()] * 4 + [SamplingParams(temperature=0.7, seed=i) for i in range(4)]
    fast = Sampler(torch.device("cpu"))(logits, _rows(params))
    monkeypatch.setattr(cpu_kernels, "enabled_and_loaded", lambda: False)
    slow = Sampler(torch.device("cpu"))(logits, _rows(params))
    assert fast.token_ids == slow.token_ids
    # Both within float32 rounding of the exact value (~1e-5 at this vocabulary).
    assert fast.logprobs == pytest.approx(slow.logprobs, rel=0, abs=2e-5)


def test_sampler_falls_back_on_rows_that_are_not_finite() -> None:
    logits = torch.randn(2, 300)
    logits[1, 7] = float("nan")
    out = Sampler(torch.device("cpu"))(logits, _rows([SamplingParams()] * 2))
    assert out.token_ids == logits.argmax(dim=-1).tolist()  # torch's NaN-first semantics
    assert out.token_ids[1] == 7
