"""Fixtures for the deployment tests: a tiny real model, the pinned tools."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from genserve.testing.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-deploy"), arch="llama", seed=1)


@pytest.fixture(scope="session")
def tools_bin() -> Path:
    """.tools/bin (grpcurl, ghz, grpc_health_probe ...) from scripts/tools.sh (idempotent)."""
    subprocess.run(["bash", str(ROOT / "scripts" / "tools.sh")], check=True)
    return ROOT / ".tools" / "bin"
