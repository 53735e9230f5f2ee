"""genserve-bench quant-accuracy: the agreement, logprob-delta and perplexity arithmetic, and
the summary row built from them (no server)."""

from __future__ import annotations

import math

import pytest

from genserve.bench.accuracy_texts import PASSAGE, PROMPTS
from genserve.bench.cli import main as bench_main
from genserve.bench.quant_accuracy import (
    ConfigResult,
    abs_deltas,
    agreement,
    common_prefix_len,
    markdown_table,
    perplexity,
    summarize,
)


def test_common_prefix_and_agreement() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([5], [6]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (True, 1.0)
    assert agreement([1, 2, 3, 4], [1, 2, 9, 4]) == (False, 0.5)
    # Stopping early (or running on) is a divergence: the longer output is the denominator.
    assert agreement([1, 2, 3, 4], [1, 2]) == (False, 0.5)
    assert agreement([1, 2], [1, 2, 3, 4]) == (False, 0.5)
    assert agreement([], []) == (True, 1.0)
    assert agreement([7], []) == (False, 0.0)


def test_abs_deltas() -> None:
    assert abs_deltas([-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5]) == [0.5, 1.0, 0.0]
    with pytest.raises(ValueError, match="length"):
        abs_deltas([-1.0], [-1.0, -2.0])


def test_perplexity() -> None:
    assert perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)
    assert perplexity([0.0, 0.0]) == 1.0
    # exp of the mean negative log-likelihood: geometric mean of 1/p.
    assert perplexity([math.log(0.25), math.log(1.0)]) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        perplexity([])


def test_summarize_against_baseline() -> None:
    base = ConfigResult(
        "float32",
        ["--dtype", "float32"],
        model_dtype="float32",
        generated_ids=[[1, 2, 3, 4], [5, 6]],
        forced_logprobs=[[-0.1, -0.2, -0.3, -0.4], [-1.0, -2.0]],
        passage_logprobs=[math.log(0.5)] * 3,
    )
    other = ConfigResult(
        "int4",
        [],
        generated_ids=[[1, 2, 3, 4], [5, 7]],
        forced_logprobs=[[-0.1, -0.2, -0.3, -0.4], [-1.5, -2.0]],
        passage_logprobs=[math.log(0.25)] * 3,
    )
    own = summarize(base, base)
    assert own["exact_match"] == 1.0 and own["mean_agreeing_prefix"] == 1.0
    assert own["max_abs_dlogprob"] == 0.0 and own["ppl_ratio"] == 1.0
    row = summarize(base, other)
    assert row["config"] == "int4"
    assert row["exact_match"] == 0.5
    assert row["mean_agreeing_prefix"] == pytest.approx((1.0 + 0.5) / 2)
    assert row["mean_abs_dlogprob"] == pytest.approx(0.5 / 6)
    assert row["max_abs_dlogprob"] == pytest.approx(0.5)
    assert row["perplexity"] == pytest.approx(4.0)
    assert row["ppl_ratio"] == pytest.approx(2.0)
    table = markdown_table([own, row], "float32")
    assert table.splitlines()[0].startswith("| config |")
    assert "| int4 | 0.500 | 0.750 |" in table
    assert "MiB" not in table  # no server reported its weight bytes
    other.weight_bytes = 3 * 2**20
    sized = markdown_table([summarize(base, other)], "float32")
    assert "weights (MiB)" in sized and "| int4 | 3.0 | 0.500 |" in sized


def test_fixed_inputs_and_cli_registration(capsys: pytest.CaptureFixture[str]) -> None:
    assert len(PROMPTS) == 16 and len(set(PROMPTS)) == 16
    assert 2000 < len(PASSAGE) < 4000  # about 400-600 tokens of English prose
    with pytest.raises(SystemExit):  # bad configuration names fail before any server starts
        bench_main(["quant-accuracy", "--configs", "float32,nonsense"])
    assert "nonsense" in capsys.readouterr().err


def test_distribution_measures() -> None:
    """dist_compare's measures on hand-made distributions: identical sides agree fully
    with zero KL; a flipped top token counts; the KL is the textbook one."""
    import numpy as np

    from genserve.bench import dist_compare

    p = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]]))
    q = np.log(np.array([[0.2, 0.7, 0.1], [0.1, 0.6, 0.3]]))
    ids = [0, 0, 1]
    ref = dist_compare.Distributions("ref", p)
    same = dist_compare.compare(ref, dist_compare.Distributions("same", p.copy()), ids)
    assert same["top1_agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0.0, abs=1e-12)
    assert same["ppl_ratio"] == pytest.approx(1.0)
    other = dist_compare.compare(ref, dist_compare.Distributions("q", q), ids)
    assert other["top1_agreement"] == 0.5
    kl0 = 0.7 * math.log(0.7 / 0.2) + 0.2 * math.log(0.2 / 0.7)
    assert other["mean_kl"] == pytest.approx(kl0 / 2)
    # ppl of ids[1:] = (0, 1): exp(-(log .7 + log .6)/2) vs exp(-(log .2 + log .6)/2)
    assert other["ppl_ratio"] == pytest.approx(math.sqrt(0.7 / 0.2))
    row = dist_compare.dense([(0, -1.0), (1, -2.0), (2, -3.0)], 3, "x")
    assert row.tolist() == [-1.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="1 of 3"):
        dist_compare.dense([(0, -1.0), (1, -2.0)], 3, "x")
