"""bench.step_host runs every step kind (it broke once when the runner started to need a
placeholder's request sampled in the step just before, and nothing ran it)."""

from __future__ import annotations

from genserve.bench.step_host import measure


def test_every_step_kind_runs_and_reports_its_host_time() -> None:
    results = measure(repeats=1)
    assert [r["kind"] for r in results] == [
        "decode-256", "decode-64", "decode-1", "mixed-256", "mixed-64",
    ]  # fmt: skip
    for r in results:
        assert r["step_ms"] > 0 and r["ops"] > 0
        assert 0 <= r["graph_ms"] <= r["step_ms"]
