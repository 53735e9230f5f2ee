"""Finding an adapter by id: local directories are probed first; with --adapter-source hub
other ids are looked up in the local Hugging Face cache only (a cache laid out as the hub
client writes it: refs/main → snapshots/<commit>).  Failures name the adapter: NOT_FOUND
(AdapterNotFoundError) when nothing is there, INVALID_ARGUMENT (AdapterError) for a
directory that is not a PEFT adapter."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from genserve.engine.adapter_manager import AdapterManager
from genserve.model.adapter_errors import AdapterError, AdapterNotFoundError
from genserve.model.adapter_files import resolve_adapter_dir
from genserve.model.config import load_model_config
from tests.conftest import TinyModelFactory

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_and_adapter(
    tiny_model_factory: TinyModelFactory, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    from genserve.testing.tiny_lora import make_lora_adapter

    base = tiny_model_factory("llama")
    return base, make_lora_adapter(base, tmp_path_factory.mktemp("adapter"), rank=2, seed=5)


def fake_hub_cache(root: Path, repo_id: str, adapter: Path) -> Path:
    """``repo_id`` cached under ``root`` the way huggingface_hub stores a download."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(adapter, snapshot)
    return snapshot


def test_local_directory_and_missing_path(
    base_and_adapter: tuple[Path, Path], tmp_path: Path
) -> None:
    _, adapter = base_and_adapter
    assert resolve_adapter_dir("mine", str(adapter), "local") == adapter
    assert resolve_adapter_dir(str(adapter), None, "local") == adapter
    # A local directory wins even under --adapter-source hub.
    assert resolve_adapter_dir(str(adapter), None, "hub", tmp_path / "empty-cache") == adapter
    with pytest.raises(AdapterNotFoundError, match=r"'gone'.*hub ids need --adapter-source hub"):
        resolve_adapter_dir("gone", str(tmp_path / "gone"), "local")
    (tmp_path / "not-an-adapter").mkdir()
    with pytest.raises(AdapterError, match=r"'odd'.*not a PEFT adapter"):
        resolve_adapter_dir("odd", str(tmp_path / "not-an-adapter"), "local")


def test_hub_ids_come_from_the_local_cache_only(
    base_and_adapter: tuple[Path, Path], tmp_path: Path
) -> None:
    _, adapter = base_and_adapter
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, "org/tiny-lora", adapter)
    assert resolve_adapter_dir("org/tiny-lora", None, "hub", cache) == snapshot
    # --lora-adapters short=org/tiny-lora: the entry's value is the hub id.
    assert resolve_adapter_dir("short", "org/tiny-lora", "hub", cache) == snapshot
    with pytest.raises(AdapterNotFoundError, match="'org/other' is not in the local Hugging"):
        resolve_adapter_dir("org/other", None, "hub", cache)
    with pytest.raises(AdapterNotFoundError, match="neither a local directory nor a hub id"):
        resolve_adapter_dir("bad id!", None, "hub", cache)


def test_manager_loads_a_cached_hub_adapter_on_demand(
    base_and_adapter: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    base, adapter = base_and_adapter
    cache = tmp_path / "hub"
    snapshot = fake_hub_cache(cache, "org/tiny-lora", adapter)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))

    async def scenario() -> None:
        m = AdapterManager(load_model_config(base), source="hub", max_active=2)
        ref = await m.acquire("org/tiny-lora")
        assert ref.path == str(snapshot.resolve())
        m.release(ref)
        with pytest.raises(AdapterNotFoundError, match="'org/missing'"):
            await m.acquire("org/missing")

    asyncio.run(scenario())
