"""Where the CPU kernels are loaded from: a server whose --genserve-cache is not the one the
bootstrap built into loads the bootstrap's build instead of compiling at its first start, and
loads it as it is (no ninja run in the bootstrap's directory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from genserve.kernels import cpu as cpu_kernels


def test_a_build_in_the_default_cache_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "genserve_cpu_kernels_avx512_0123456789"
    default, configured = tmp_path / "default", tmp_path / "configured"
    monkeypatch.setattr(cpu_kernels, "_DEFAULT_CACHE_DIR", default)
    monkeypatch.setattr(cpu_kernels._settings, "cache_dir", configured)
    assert cpu_kernels._build_directory(name) == configured / name  # nothing built anywhere
    (default / name).mkdir(parents=True)
    (default / name / f"{name}.so").write_bytes(b"")
    assert cpu_kernels._build_directory(name) == default / name
    (configured / name).mkdir(parents=True)
    (configured / name / f"{name}.so").write_bytes(b"")
    assert cpu_kernels._build_directory(name) == configured / name  # its own build first


def test_bootstrap_builds_where_the_server_looks() -> None:
    """scripts/bootstrap.sh builds into $GENSERVE_CACHE/kernels, the launcher's default."""
    script = (Path(__file__).parents[2] / "scripts" / "bootstrap.sh").read_text()
    assert '--cache-dir "${GENSERVE_CACHE:-$HOME/.cache/genserve}/kernels"' in script


def test_the_bootstrap_build_is_loaded_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ninja rebuilds a build whose sources sat elsewhere (another checkout of the same code):
    a finished build in the default cache is loaded directly, never handed to ninja."""
    default, configured = tmp_path / "default", tmp_path / "configured"
    name = f"genserve_cpu_kernels_{cpu_kernels._isa_level().lower()}_{cpu_kernels._content_hash()}"
    (default / name).mkdir(parents=True)
    (default / name / f"{name}.so").write_bytes(b"")
    monkeypatch.setattr(cpu_kernels, "_DEFAULT_CACHE_DIR", default)
    monkeypatch.setattr(cpu_kernels._settings, "cache_dir", configured)
    loaded: list[str] = []
    built: list[str] = []

    def load_library(path: str) -> None:
        loaded.append(path)
        raise OSError("not a real library")  # the caller falls back to torch ops

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]))
    assert cpu_kernels._build_and_load() is False
    assert loaded == [str(default / name / f"{name}.so")]
    assert built == []
    assert not configured.exists()
