"""The closed-loop step-mix simulation of issue #29 (``genserve.bench.mixed_steps``): the real
scheduler under the bench's load, counting the steps that carry prompt tokens."""

from __future__ import annotations

from genserve.bench.mixed_steps import LoadShape, StepCost, simulate

COST = StepCost()


def test_without_batching_arrivals_make_most_steps_mixed() -> None:
    """Each arrival joins at once: at 64 streams and 32-token answers, 2 requests end and 2
    join nearly every step, so almost every steady step carries a prompt."""
    row = simulate(LoadShape(64, new_tokens=32, requests=256), False, COST)
    assert row["steady_mixed_fraction"] > 0.9
    assert row["admitted_per_mixed_step"] < 3
    assert row["ttft_steps_p50"] == 1


def test_batching_gathers_arrivals_into_one_mixed_step_per_window() -> None:
    """TGI's rule with a full batch (``floor(running * 1.2)`` arrivals never wait at once)
    admits every ``max_waiting_tokens`` steps: about one step in that many is mixed, each
    with that many steps' arrivals, and a request waits at most the window."""
    row = simulate(LoadShape(64, new_tokens=32, requests=256), True, COST, max_waiting_tokens=8)
    assert 0 < row["steady_mixed_fraction"] <= 1 / 6
    assert row["admitted_per_mixed_step"] > 5
    assert row["ttft_steps_p50"] <= 8
    # Every request ran to the end: as many output tokens per request as asked.
    off = simulate(LoadShape(64, new_tokens=32, requests=256), False, COST)
    assert row["steps"] < off["steps"] + 8 * 8  # bounded by the windows the ramp adds


def test_cost_model_charges_eager_launches_to_mixed_steps_only() -> None:
    assert COST.step_ms(64, 0) == COST.graph_ms + 64 * COST.row_ms
    assert COST.step_ms(64, 100) == COST.step_ms(64, 0) + COST.eager_ms + 0.1 * COST.prefill_us
