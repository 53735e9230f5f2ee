"""The Go (`go test ./...`) and Java (`mvn -q test`) client suites, run as part of pytest so that
the README's test command covers them.  Each starts its own real genserve process with the
model and launcher handed over here."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.clients.conftest import ROOT
from tests.utils.live_server import genserve_command


def suite_env(tiny_model: Path) -> dict[str, str]:
    (launcher,) = genserve_command()[:1]
    return {
        **os.environ,
        "GENSERVE_TEST_MODEL": str(tiny_model),
        "GENSERVE_BIN": launcher,
        "GENSERVE_REPO_ROOT": str(ROOT),
    }


def run_suite(cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
    assert shutil.which(cmd[0]), f"{cmd[0]} is not installed"
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


def test_go_client_suite(tiny_model: Path) -> None:
    run_suite(["go", "test", "-count=1", "./..."], ROOT / "clients" / "go", suite_env(tiny_model))


def test_java_client_suite(tiny_model: Path) -> None:
    run_suite(["mvn", "-q", "-B", "test"], ROOT / "clients" / "java", suite_env(tiny_model))
