"""Which path serves a checkpoint (native, transformers, transformers-sequential) and what
the fallback switches off or refuses — decided from config.json alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from genserve.config import load_config
from genserve.model.config import UnsupportedModelError
from genserve.model.fallback_options import disabled_features, restrict_for_fallback
from genserve.model.serving_path import (
    NATIVE,
    TRANSFORMERS,
    TRANSFORMERS_SEQUENTIAL,
    choose_serving_path,
)


def _config_dir(tmp_path: Path, model_type: str, **fields: Any) -> Path:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **fields)
    out = tmp_path / model_type
    config.save_pretrained(str(out))
    return out


@pytest.mark.parametrize(
    ("model_type", "fields", "implementation", "architecture"),
    [
        ("llama", {}, NATIVE, "LlamaForCausalLM"),
        # Native families (model/families) since wave 3; a config.json without
        # ``architectures`` is native only for the model types families/__init__.py maps.
        ("qwen3", {}, NATIVE, "Qwen3ForCausalLM"),
        ("gemma2", {"architectures": ["Gemma2ForCausalLM"]}, NATIVE, "Gemma2ForCausalLM"),
        (
            "starcoder2",
            {"architectures": ["Starcoder2ForCausalLM"]},
            NATIVE,
            "Starcoder2ForCausalLM",
        ),
        ("gemma2", {}, TRANSFORMERS, "Gemma2ForCausalLM"),
        # Mixture of experts (model/moe.py): native since #26.
        ("mixtral", {}, NATIVE, "MixtralForCausalLM"),
        ("qwen3_moe", {}, NATIVE, "Qwen3MoeForCausalLM"),
        ("gpt_oss", {}, NATIVE, "GptOssForCausalLM"),
        ("minimax_m2", {}, NATIVE, "MiniMaxM2ForCausalLM"),
        # The released gpt-oss checkpoints' MXFP4 experts are read natively (model/mxfp4.py);
        # another quantization method is not.
        (
            "gpt_oss",
            {"quantization_config": {"quant_method": "mxfp4"}},
            NATIVE,
            "GptOssForCausalLM",
        ),
        (
            "gpt_oss",
            {"quantization_config": {"quant_method": "fp8"}},
            TRANSFORMERS,
            "GptOssForCausalLM",
        ),
        ("falcon", {}, TRANSFORMERS_SEQUENTIAL, "FalconForCausalLM"),
        ("qwen3_5_text", {}, TRANSFORMERS_SEQUENTIAL, "Qwen3_5ForCausalLM"),
        # Llama-4's query temperature depends on the input index: one sequence at a time.
        ("llama4_text", {}, TRANSFORMERS_SEQUENTIAL, "Llama4ForCausalLM"),
        ("llama4_text", {"attn_temperature_tuning": False}, TRANSFORMERS, "Llama4ForCausalLM"),
    ],
)
def test_path_by_architecture(
    tmp_path: Path, model_type: str, fields: dict[str, Any], implementation: str, architecture: str
) -> None:
    path = choose_serving_path(_config_dir(tmp_path, model_type, **fields))
    assert path.implementation == implementation
    assert path.architecture == architecture


def test_model_impl_transformers_skips_native(tmp_path: Path) -> None:
    path = choose_serving_path(_config_dir(tmp_path, "llama"), model_impl="transformers")
    assert path.implementation == TRANSFORMERS


def test_no_causal_lm_class_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="transformers fallback cannot serve"):
        choose_serving_path(_config_dir(tmp_path, "t5"))


def test_sequential_path_switches_off_prefix_caching_and_speculation(tmp_path: Path) -> None:
    path = choose_serving_path(_config_dir(tmp_path, "falcon"))
    config = restrict_for_fallback(load_config(["--speculate", "2"], environ={}), path)
    assert config.disable_prefix_caching and config.speculate == 0 and config.cuda_graphs == ()
    names = {f.split(":")[0] for f in disabled_features(path)}
    assert {"prefix_caching", "speculation", "lora", "sharding"} <= names


def _paged_fallback_dir(tmp_path: Path) -> Path:
    """A gpt-oss config with FP8-quantized experts (no native reader; the released MXFP4
    ones are native): the paged fallback serves it."""
    return _config_dir(tmp_path, "gpt_oss", quantization_config={"quant_method": "fp8"})


def test_paged_path_keeps_prefix_caching(tmp_path: Path) -> None:
    path = choose_serving_path(_paged_fallback_dir(tmp_path))
    assert path.implementation == TRANSFORMERS
    config = restrict_for_fallback(load_config([], environ={}), path)
    assert not config.disable_prefix_caching
    assert "prefix_caching" not in {f.split(":")[0] for f in disabled_features(path)}


@pytest.mark.parametrize(
    "args",
    [["--quantize", "int8"], ["--lora-adapters", "a=/x"], ["--rope-scaling", "linear"]],
)
def test_fallback_refuses_what_it_cannot_honour(tmp_path: Path, args: list[str]) -> None:
    path = choose_serving_path(_paged_fallback_dir(tmp_path))
    with pytest.raises(UnsupportedModelError, match="transformers fallback"):
        restrict_for_fallback(load_config(args, environ={}), path)


def test_native_path_changes_nothing(tmp_path: Path) -> None:
    path = choose_serving_path(_config_dir(tmp_path, "llama"))
    config = load_config(["--quantize", "int8"], environ={})
    assert restrict_for_fallback(config, path) == config
    assert disabled_features(path) == ()


def test_gguf_of_a_layout_not_read_natively_takes_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF whose llama.cpp tensor layout the native reader does not map goes to the
    transformers fallback (which dequantizes the file) instead of failing at load."""
    from genserve.model import gguf_names
    from genserve.model.loader import resolve_model
    from genserve.testing.tiny_gguf import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0", seed=5)
    resolved = resolve_model(str(gguf), cache_dir=tmp_path / "models")
    assert choose_serving_path(resolved.local_dir).implementation == NATIVE
    without_llama = {k: v for k, v in gguf_names.LAYOUTS.items() if k != "llama"}
    monkeypatch.setattr(gguf_names, "LAYOUTS", without_llama)
    path = choose_serving_path(resolved.local_dir)
    assert path.implementation == TRANSFORMERS
    assert "GGUF architecture 'llama' is not read natively" in path.reason
