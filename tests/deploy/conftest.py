"""Fixtures for the deployment tests: a tiny real model, the pinned tools."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import TinyModelFactory

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tiny_model_factory: TinyModelFactory) -> Path:
    """The tiny Llama (seed 1) the e2e tests serve too: built once per session."""
    return tiny_model_factory("llama", seed=1)


@pytest.fixture(scope="session")
def tools_bin() -> Path:
    """.tools/bin (grpcurl, ghz, grpc_health_probe ...) from scripts/tools.sh (idempotent)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "tools.sh")], check=True)
    return ROOT / ".tools" / "bin"
