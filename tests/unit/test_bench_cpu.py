"""genserve-bench cpu: the decode ceilings it reports (weight bytes and flops of a Llama
model, the measured machine limits) and its command line."""

from __future__ import annotations

import pytest

from genserve.bench import cpu_compare, machine_limits


def test_model_cost_counts_every_projection_and_the_head() -> None:
    # SmolLM2-135M: 30 layers, hidden 576, MLP 1536, 9 query / 3 KV heads of 64, vocab 49152.
    cost = machine_limits.model_cost(576, 1536, 30, 9, 3, 64, 49152)
    per_layer = (9 + 2 * 3) * 64 * 576 + 576 * 576 + 2 * 1536 * 576 + 576 * 1536
    assert cost.matmul_params == 30 * per_layer + 49152 * 576 == 134_479_872
    limits = machine_limits.MachineLimits(
        read_gb_s=20.0, matmul_gflop_s=100.0, matmul_rows=32, threads=2
    )
    # One read of the float32 weights per token; 2 flops per weight per token.
    assert cost.bandwidth_tok_s(limits, 4.0) == pytest.approx(20e9 / (4 * 134_479_872))
    assert cost.bandwidth_tok_s(limits, 2.0) == pytest.approx(2 * cost.bandwidth_tok_s(limits, 4))
    assert cost.matmul_tok_s(limits) == pytest.approx(100e9 / (2 * 134_479_872))


def test_measured_limits_are_positive_rates() -> None:
    assert machine_limits.read_bandwidth_gb_s(num_bytes=1 << 22, repeats=2) > 0
    assert machine_limits.matmul_gflop_s(((64, 32),), rows=4, repeats=2) > 0


def test_best_keeps_each_limits_best_measurement() -> None:
    first = machine_limits.MachineLimits(
        read_gb_s=24.0, matmul_gflop_s=190.0, matmul_rows=32, threads=2
    )
    second = machine_limits.MachineLimits(
        read_gb_s=28.5, matmul_gflop_s=180.0, matmul_rows=32, threads=2
    )
    best = machine_limits.best([first, second])
    assert (best.read_gb_s, best.matmul_gflop_s) == (28.5, 190.0)
    assert (best.matmul_rows, best.threads) == (32, 2)
    with pytest.raises(ValueError):
        machine_limits.best([])


def test_table_reports_percent_of_limit_and_agreement() -> None:
    result = {
        "rows": [
            {
                "engine": "genserve float32",
                "streams": 1,
                "tok_s": 20.0,
                "min": 19.0,
                "max": 21.0,
                "limit_tok_s": 40.0,
                "percent_of_limit": 50.0,
                "same_tokens_as_genserve float32": 1.0,
            }
        ]
    }
    table = cpu_compare.format_table(result)
    assert "| genserve float32 | 1 | 20.0 | 19.0-21.0 | 40 | 50% | 100% |" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["--precisions", "float64"],
        ["--llamacpp", "Q3_K"],
        ["--new-tokens", "1"],
        ["--repeats", "0"],
    ],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cpu_compare.main(argv)
    assert exc.value.code == 2
