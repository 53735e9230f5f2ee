"""The native families: each module maps one family's transformers config to a
:class:`~genserve.model.spec.ModelConfig` (and, through its ``names``, its checkpoint's
weight names to the decoder's parts).  Adding a family is adding a module here and a line to
``FAMILIES``; nothing outside ``model/`` learns its name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from genserve.model.families import (
    cohere,
    deepseek_v3,
    gemma,
    gemma2,
    gemma3,
    glm4_moe,
    gpt_neox,
    gpt_oss,
    granite,
    llama,
    minimax_m2,
    mixtral,
    olmo2,
    phi,
    phi3,
    qwen3,
    qwen_moe,
    smollm3,
    stablelm,
    starcoder2,
)
from genserve.model.spec import ModelConfig, UnsupportedModelError

_MODULES = (
    llama, qwen3, gemma, gemma2, gemma3, phi3, granite, olmo2, stablelm, phi, gpt_neox,
    starcoder2, cohere, smollm3, mixtral, qwen_moe,
    glm4_moe, gpt_oss, minimax_m2, deepseek_v3,
)  # fmt: skip

FAMILIES: dict[str, Callable[[Any, str], ModelConfig]] = {
    arch: module.config for module in _MODULES for arch in module.ARCHITECTURES
}

# config.json files that name no architecture: the model_type's usual one.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

NATIVE_ARCHITECTURES = tuple(FAMILIES)


def config_from_hf(hf: Any) -> ModelConfig:
    """The native spec of a transformers config; raises :class:`UnsupportedModelError`
    (naming the architecture or the feature) where no native family serves it."""
    archs: list[str] = list(getattr(hf, "architectures", None) or [])
    arch = next((a for a in archs if a in FAMILIES), None)
    if arch is None:
        arch = _BY_MODEL_TYPE.get(getattr(hf, "model_type", ""))
    if arch is None:
        named = archs or str(getattr(hf, "model_type", ""))
        raise UnsupportedModelError(
            f"architecture {named!r} is not supported "
            f"natively; genserve implements {', '.join(NATIVE_ARCHITECTURES)}"
        )
    return FAMILIES[arch](hf, arch)


def load_model_config(model_dir: Path, trust_remote_code: bool = False) -> ModelConfig:
    """Read ``model_dir/config.json`` (through transformers' ``AutoConfig``, which knows
    every historical spelling of its fields) into the native spec."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    return config_from_hf(hf)
