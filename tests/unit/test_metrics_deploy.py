"""deploy/prometheus.yml and deploy/otel-collector.yaml agree with genserve's defaults and are
internally consistent (every pipeline component is defined)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from genserve.config import Config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


def test_prometheus_scrapes_the_default_metrics_port() -> None:
    config = load("prometheus.yml")
    (job,) = (j for j in config["scrape_configs"] if j["job_name"] == "genserve")
    assert job["metrics_path"] == "/metrics"
    targets = [t for group in job["static_configs"] for t in group["targets"]]
    assert targets and all(t.endswith(f":{Config().prometheus_port}") for t in targets)


def test_collector_pipeline_is_complete() -> None:
    config = load("otel-collector.yaml")
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    traces = config["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        assert traces[kind], kind
        for name in traces[kind]:
            assert name in config[kind], f"{kind}: {name} is used but not defined"
    # The memory limiter must come first to protect the collector.
    assert traces["processors"][0] == "memory_limiter"
