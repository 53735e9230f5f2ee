"""Where the CPU kernels are loaded from: a server whose --genserve-cache is not the one the
bootstrap built into loads the bootstrap's build instead of compiling at its first start, and
loads it as it is (no ninja run in the bootstrap's directory)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from genserve.config import environment_cache
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


def test_the_kernel_cache_follows_genserve_cache(tmp_path: Path) -> None:
    """Without a launcher (tests, ``python -m genserve.kernels.cpu``) the kernels are built
    and found in $GENSERVE_CACHE/kernels, as a server started in that environment looks; a
    server given another --genserve-cache falls back to that build."""
    assert environment_cache({"GENSERVE_CACHE": str(tmp_path)}) == tmp_path
    assert environment_cache({}) == environment_cache({"GENSERVE_CACHE": ""})
    assert environment_cache({}) == Path.home() / ".cache" / "genserve"
    code = (
        "from genserve.kernels import cpu; print(cpu._settings.cache_dir, cpu._DEFAULT_CACHE_DIR)"
    )
    env = {**os.environ, "GENSERVE_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "kernels")] * 2


def test_bootstrap_builds_where_the_server_looks() -> None:
    """scripts/bootstrap.sh builds into $GENSERVE_CACHE/kernels, the launcher's default."""
    script = (Path(__file__).parents[2] / "scripts" / "bootstrap.sh").read_text()
    assert '--cache-dir "${GENSERVE_CACHE:-$HOME/.cache/genserve}/kernels"' in script


def _fake_builds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loads: bool
) -> tuple[Path, list[str], list[str]]:
    """A finished build of this code in a default cache only; records what loads and what
    ninja is asked to build (neither really happens)."""
    default, configured = tmp_path / "default", tmp_path / "configured"
    level, digest = cpu_kernels._isa_level().lower(), cpu_kernels._content_hash()
    name = f"genserve_cpu_kernels_{level}_{digest}"
    (default / name).mkdir(parents=True)
    (default / name / f"{name}.so").write_bytes(b"")
    monkeypatch.setattr(cpu_kernels, "_DEFAULT_CACHE_DIR", default)
    monkeypatch.setattr(cpu_kernels._settings, "cache_dir", configured)
    loaded: list[str] = []
    built: list[str] = []

    def load_library(path: str) -> None:
        loaded.append(path)
        if not loads:
            raise OSError("file too short")

    monkeypatch.setattr(torch.ops, "load_library", load_library)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw["name"]))
    return default / name / f"{name}.so", loaded, built


def test_a_finished_build_is_loaded_without_ninja(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ninja rebuilds a build compiled from other paths (another checkout of the same code):
    a finished build is loaded as it is, wherever it lies."""
    library, loaded, built = _fake_builds(tmp_path, monkeypatch, loads=True)
    cpu_kernels._build_and_load()
    assert loaded == [str(library)]
    assert built == []
    assert not (tmp_path / "configured").exists()


def test_a_library_that_does_not_load_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library, loaded, built = _fake_builds(tmp_path, monkeypatch, loads=False)
    cpu_kernels._build_and_load()
    assert loaded == [str(library)]
    assert built == [library.stem]


def test_every_kernel_source_is_in_the_build_name() -> None:
    """A finished build is trusted by its name alone: every file the compiler reads is
    hashed into it."""
    kernels = Path(cpu_kernels.__file__).parent
    on_disk = {p.name for p in kernels.iterdir() if p.suffix in (".cpp", ".h", ".inc")}
    hashed = {p.name for p in (*cpu_kernels._SOURCES, *cpu_kernels._HEADERS)}
    assert on_disk == hashed


def test_the_bootstrap_honours_the_cpu_features_mask(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``python -m genserve.kernels.cpu`` takes the mask a server takes (env var, or the option
    over it) and builds the library of that level: with ``avx2``, the AVX2-level one."""
    if cpu_kernels._isa_level() not in ("AVX2", "AVX512"):
        pytest.skip("the AVX2 level exists only on x86-64 with AVX2")
    # A fresh settings object: nothing configured here leaks into the other tests.
    monkeypatch.setattr(cpu_kernels, "_settings", cpu_kernels._Settings())
    monkeypatch.setattr(cpu_kernels, "_DEFAULT_CACHE_DIR", tmp_path / "default")
    seen: list[tuple[tuple[str, ...], str]] = []

    def record_load() -> bool:  # stands in for the minutes-long build only
        seen.append((cpu_kernels.hidden_features(), cpu_kernels._isa_level()))
        return True

    monkeypatch.setattr(cpu_kernels, "load", record_load)
    monkeypatch.setenv("GENSERVE_CPU_FEATURES_MASK", "avx2")
    assert cpu_kernels.main(["--cache-dir", str(tmp_path)]) == 0
    assert "avx512f" in seen[-1][0] and seen[-1][1] == "AVX2"
    out = capsys.readouterr().out
    assert "level AVX2" in out and "genserve_cpu_kernels_avx2_" in out and str(tmp_path) in out
    assert cpu_kernels._settings.cache_dir == tmp_path

    assert cpu_kernels.main(["--cache-dir", str(tmp_path), "--cpu-features-mask", "gfni"]) == 0
    assert seen[-1][0] == ("gfni",)  # the option over the environment

    monkeypatch.setenv("GENSERVE_CPU_FEATURES_MASK", "avx3")
    with pytest.raises(SystemExit) as exit_info:
        cpu_kernels.main(["--cache-dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "'avx3' is not one of" in capsys.readouterr().err
    assert len(seen) == 2  # a typo builds nothing


def test_the_bootstrap_finds_a_prebuilt_avx2_library() -> None:
    """The real command with the mask loads the AVX2-level library already in the cache
    (no build: skipped where the environment's cache has none for this code)."""
    if cpu_kernels._isa_level() not in ("AVX2", "AVX512"):
        pytest.skip("the AVX2 level exists only on x86-64 with AVX2")
    name = f"genserve_cpu_kernels_avx2_{cpu_kernels._content_hash()}"
    cache = environment_cache() / "kernels"
    if not (cache / name / f"{name}.so").is_file():
        pytest.skip(f"no prebuilt AVX2-level library in {cache} (the bootstrap with the mask)")
    env = {**os.environ, "GENSERVE_CPU_FEATURES_MASK": "avx2"}
    proc = subprocess.run(
        [sys.executable, "-m", "genserve.kernels.cpu", "--cache-dir", str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "genserve CPU kernels: ready" in proc.stdout
    assert f"level AVX2, library {cache / name / name}.so" in proc.stdout
    assert "compiled=False" in proc.stdout + proc.stderr


def test_every_kernel_file_is_built_and_installed() -> None:
    """Every header the kernels include is part of the build's inputs (a change to it makes a
    new library, not a stale one), and every source and header is package data (a
    non-editable install builds them where it is installed)."""
    import fnmatch
    import tomllib

    here = Path(cpu_kernels.__file__).parent
    on_disk = {p.name for p in here.iterdir() if p.suffix in (".h", ".inc")}
    assert on_disk <= {p.name for p in cpu_kernels._HEADERS}
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]
    for path in [*cpu_kernels._SOURCES, *cpu_kernels._HEADERS]:
        assert any(fnmatch.fnmatch(path.name, p) for p in patterns["genserve.kernels"]), path.name
