"""The architecture description the native model is built from.

``config.json`` is parsed by transformers' ``AutoConfig`` (which knows every historical spelling:
``rope_theta``/``rope_scaling`` vs ``rope_parameters``, Qwen2's ``use_sliding_window``, ...)
and reduced to the few fields the Llama family needs.  The model code never touches a
transformers object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family model this server implements natively."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' ``rope_parameters``)."""

    rope_type: str = "default"
    theta: float = 10000.0
    # Extra keys of the scaling kind, e.g. ``factor``, ``low_freq_factor`` (llama3).
    params: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig
    # Per layer: attend only to the last ``w`` positions (Mistral, Qwen2 sliding layers).
    sliding_windows: tuple[int | None, ...]
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pretrained(cls, model_dir: Path, trust_remote_code: bool = False) -> ModelConfig:
        """Read ``model_dir/config.json``; raises :class:`UnsupportedModelError` for
        architectures or features the native implementation does not have."""
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        return cls.from_hf(hf)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        archs = list(getattr(hf, "architectures", None) or [])
        model_type = getattr(hf, "model_type", "")
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
            by_type["qwen2"] = "Qwen2ForCausalLM"
            arch = by_type.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"architecture {archs or model_type!r} is not supported; genserve implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        num_heads = int(hf.num_attention_heads)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        num_layers = int(hf.num_hidden_layers)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.rms_norm_eps),
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's flag covers all four.
            qkv_bias=True if is_qwen2 else bool(getattr(hf, "attention_bias", False)),
            o_bias=False if is_qwen2 else bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope=_rope_config(hf),
            sliding_windows=_sliding_windows(hf, arch, num_layers),
            eos_token_ids=_eos_ids(getattr(hf, "eos_token_id", None)),
        )


def _rope_config(hf: Any) -> RopeConfig:
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:  # transformers < 5 spelling
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    if float(params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if rope_type in ("llama3", "yarn", "longrope", "dynamic"):
        params.setdefault("original_max_position_embeddings", hf.max_position_embeddings)
    numeric = {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
    return RopeConfig(rope_type=rope_type, theta=theta, params=numeric)


def _sliding_windows(hf: Any, arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    if window is None:
        return (None,) * num_layers
    layer_types = getattr(hf, "layer_types", None)
    if arch == "Qwen2ForCausalLM" and layer_types is not None:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * num_layers


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return ()
