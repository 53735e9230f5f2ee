"""Model resolution (local directory, embedded default GGUF, HF cache layout, .bin
conversion), the conversion cache's concurrency safety, and per-tensor weight access."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from genserve.config import load_config
from genserve.model import model_cache
from genserve.model.config import UnsupportedModelError, load_model_config
from genserve.model.loader import DEFAULT_GGUF_NAME, ModelNotFoundError, resolve_model
from genserve.model.weight_files import has_weights, weight_files
from genserve.model.weights import MissingWeightError, SafetensorsWeights
from tests.conftest import TinyModelFactory


def test_local_directory_is_used_in_place(tiny_model_factory: TinyModelFactory) -> None:
    model_dir = tiny_model_factory("llama")
    resolved = resolve_model(str(model_dir), revision="v1", cache_dir=Path("/nonexistent"))
    assert resolved.local_dir == model_dir
    assert (resolved.model_id, resolved.revision) == (str(model_dir), "v1")


def test_embedded_default_is_converted_once_and_cached() -> None:
    cache = load_config([]).genserve_cache / "models"  # shared with the tiny models' tokenizer
    resolved = resolve_model(None, cache_dir=cache)
    assert resolved.model_id == DEFAULT_GGUF_NAME
    assert resolved.revision is not None and resolved.revision.startswith("sha256-sampled:")
    assert resolved.local_dir.parent == cache
    assert resolved.local_dir.name.startswith("gguf-")  # keyed by content, not file name
    for name in ("config.json", "tokenizer.json"):
        assert (resolved.local_dir / name).is_file()
    # No float copy of the weights: they are read from the GGUF file itself at every start.
    assert not list(resolved.local_dir.glob("*.safetensors"))
    config = load_model_config(resolved.local_dir)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (30, 9, 3)
    started = time.monotonic()
    assert resolve_model(None, cache_dir=cache) == resolved
    assert time.monotonic() - started < 5  # the cache is hit, nothing is converted


def _fake_hub_cache(root: Path, repo: str, model_dir: Path, sha: str) -> None:
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(sha)
    shutil.copytree(model_dir, repo_dir / "snapshots" / sha)


def test_hub_id_found_in_local_cache(
    tiny_model_factory: TinyModelFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    sha = "0123456789abcdef0123456789abcdef01234567"
    _fake_hub_cache(tmp_path, "acme/tiny", tiny_model_factory("qwen2"), sha)
    resolved = resolve_model("acme/tiny", hub_cache=tmp_path, cache_dir=tmp_path / "conv")
    assert resolved.local_dir == tmp_path / "models--acme--tiny" / "snapshots" / sha
    assert (resolved.model_id, resolved.revision) == ("acme/tiny", sha)

    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/absent", hub_cache=tmp_path, cache_dir=tmp_path / "conv")
    assert "acme/absent" in str(err.value) and str(tmp_path) in str(err.value)


def test_bad_model_ids_fail_clearly(tmp_path: Path) -> None:
    (tmp_path / "weights.txt").write_text("not a model")
    with pytest.raises(ModelNotFoundError, match=r"not a \.gguf"):
        resolve_model(str(tmp_path / "weights.txt"), cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="no such file"):
        resolve_model(str(tmp_path / "missing"), cache_dir=tmp_path)
    with pytest.raises(ModelNotFoundError, match="no model weights"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)


def test_pytorch_bin_directory_is_converted(
    tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    source = tiny_model_factory("mistral")
    bin_dir = tmp_path / "bin-model"
    shutil.copytree(source, bin_dir, ignore=shutil.ignore_patterns("*.safetensors"))
    with SafetensorsWeights(source) as original:
        state = {name: original.get(name) for name in original.names()}
    torch.save(state, bin_dir / "pytorch_model.bin")  # the pre-safetensors checkpoint format
    first = resolve_model(str(bin_dir), cache_dir=tmp_path / "cache")
    assert first.local_dir.parent == tmp_path / "cache"
    with SafetensorsWeights(first.local_dir) as converted, SafetensorsWeights(source) as original:
        name = "model.layers.1.mlp.down_proj.weight"
        assert torch.equal(converted.get(name), original.get(name))
    assert resolve_model(str(bin_dir), cache_dir=tmp_path / "cache") == first


def test_concurrent_conversions_convert_once(tmp_path: Path) -> None:
    calls: list[Path] = []

    def slow_convert(out: Path) -> None:
        calls.append(out)
        time.sleep(0.3)
        (out / "model.safetensors").write_bytes(b"x")
        (out / "config.json").write_text("{}")

    target = tmp_path / "cache" / "model-abc"
    results: list[Path] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(model_cache.build_once(target, slow_convert, "src"))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3 and len(calls) == 1
    # Only the finished directory remains: no temporary directory, no lock file.
    assert _leftovers(target.parent) == ["model-abc"]


def test_failed_conversion_leaves_nothing(tmp_path: Path) -> None:
    def broken(out: Path) -> None:
        (out / "partial").write_text("half")
        raise RuntimeError("disk full")

    target = tmp_path / "model-x"
    with pytest.raises(RuntimeError, match="disk full"):
        model_cache.build_once(target, broken, "src")
    assert not target.exists()
    assert _leftovers(tmp_path) == []


def _leftovers(cache: Path) -> list[str]:
    """Every file or directory in ``cache`` but the (empty) bookkeeping directories."""
    return sorted(
        str(p.relative_to(cache))
        for p in cache.rglob("*")
        if (p.parent == cache and not p.name.startswith(".")) or p.parent.name in (".tmp", ".locks")
    )


def test_weight_slices(tiny_model_factory: TinyModelFactory) -> None:
    with SafetensorsWeights(tiny_model_factory("llama")) as weights:
        name = "model.layers.0.self_attn.q_proj.weight"
        full = weights.get(name)
        assert weights.shape(name) == tuple(full.shape) == (64, 64)
        assert torch.equal(weights.get_slice(name, 0, 16, 32), full[16:32])
        assert torch.equal(weights.get_slice(name, 1, 48, 64), full[:, 48:64])
        assert weights.has(name) and not weights.has("lm_head.weight")  # tied embeddings
        with pytest.raises(MissingWeightError):
            weights.get("model.layers.9.mlp.up_proj.weight")


def test_config_parsing(tmp_path: Path, tiny_model_factory: TinyModelFactory) -> None:
    qwen = load_model_config(tiny_model_factory("qwen2"))
    assert qwen.qkv_bias and not qwen.attention.o_bias and qwen.sliding_windows == (None, None)
    mistral = load_model_config(tiny_model_factory("mistral"))
    assert mistral.sliding_windows == (32, 32) and not mistral.tie_word_embeddings

    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rope_theta": 5000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    (tmp_path / "config.json").write_text(__import__("json").dumps(legacy))
    rope = load_model_config(tmp_path).rope
    assert (rope.rope_type, rope.theta, dict(rope.params)) == ("linear", 5000.0, {"factor": 2.0})

    legacy.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(__import__("json").dumps(legacy))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        load_model_config(tmp_path)


def test_only_the_models_own_safetensors_are_weights(
    tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    # Caches and foreign files beside the weights are never read as the model's tensors.
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_factory("llama"), model_dir)
    (model_dir / "gguf-blocks-0123456789abcdef.safetensors").write_bytes(b'{},"__metadata__":{}}')
    (model_dir / "adapter.safetensors").write_bytes(b"junk")
    assert weight_files(model_dir) == ["model.safetensors"]
    with SafetensorsWeights(model_dir) as weights:
        assert weights.has("model.embed_tokens.weight")
    # Without model*.safetensors or an index, a directory holds no weights.
    (model_dir / "model.safetensors").unlink()
    assert not has_weights(model_dir)
    with pytest.raises(ModelNotFoundError, match="no model weights"):
        resolve_model(str(model_dir), cache_dir=tmp_path / "cache")
