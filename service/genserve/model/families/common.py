"""Helpers shared by the family modules: reading a transformers config into spec fields."""

from __future__ import annotations

from typing import Any

from genserve.model.spec import (
    Activation,
    ModelConfig,
    MoeNames,
    MoeSpec,
    RopeConfig,
    RouterSpec,
    Scoring,
    UnsupportedModelError,
)

_ACTIVATIONS = {
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "gelu": Activation.GELU,
    "gelu_new": Activation.GELU_TANH,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
}


def activation(name: str | None) -> Activation:
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden activation {name!r} is not supported ({', '.join(_ACTIVATIONS)} are)"
        )
    return _ACTIVATIONS[name]


def head_dim(hf: Any) -> int:
    return int(getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)


def rope_config(hf: Any, layer_type: str | None = None) -> RopeConfig:
    """The rotary parameters (of ``layer_type`` where they are given per layer type)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    elif "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])
    if not params:  # transformers < 5 spelling
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    params.pop("partial_rotary_factor", None)  # see rotary_dim
    if rope_type in ("llama3", "yarn", "longrope", "dynamic"):
        original = getattr(hf, "original_max_position_embeddings", None)
        if original is not None and rope_type != "dynamic":
            params["original_max_position_embeddings"] = original  # Phi-3 keeps it outside the dict
        params.setdefault("original_max_position_embeddings", hf.max_position_embeddings)
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        params["factor"] = hf.max_position_embeddings / params["original_max_position_embeddings"]
    short = tuple(float(v) for v in params.pop("short_factor", None) or ())
    long = tuple(float(v) for v in params.pop("long_factor", None) or ())
    numeric = {k: float(v) for k, v in params.items() if isinstance(v, int | float)}
    return RopeConfig(rope_type, theta, numeric, short_factor=short, long_factor=long)


def rotary_dim(hf: Any) -> int | None:
    """Rotated features per head where fewer than all (``partial_rotary_factor``)."""
    params = getattr(hf, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0))
    if factor is None or float(factor) == 1.0:
        return None
    return int(head_dim(hf) * float(factor))


def sliding_windows(hf: Any) -> tuple[int | None, ...]:
    """Per layer: ``sliding_window`` on the layers ``layer_types`` calls sliding (on every
    layer when the config has no ``layer_types``), None elsewhere."""
    n = int(hf.num_hidden_layers)
    window = getattr(hf, "sliding_window", None)
    if window is None or getattr(hf, "use_sliding_window", True) is False:
        return (None,) * n
    types = getattr(hf, "layer_types", None)
    if types is None:
        return (int(window),) * n
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def eos_ids(value: object) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return ()


def base_config(hf: Any, architecture: str, **parts: Any) -> ModelConfig:
    """The fields every family reads the same way; ``parts`` sets the rest."""
    num_heads = int(hf.num_attention_heads)
    fields: dict[str, Any] = {
        "architecture": architecture,
        "vocab_size": int(hf.vocab_size),
        "hidden_size": int(hf.hidden_size),
        "intermediate_size": int(hf.intermediate_size),
        "num_layers": int(hf.num_hidden_layers),
        "num_heads": num_heads,
        "num_kv_heads": int(getattr(hf, "num_key_value_heads", None) or num_heads),
        "head_dim": head_dim(hf),
        "max_position_embeddings": int(getattr(hf, "max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(getattr(hf, "tie_word_embeddings", False)),
        "rope": rope_config(hf),
        "sliding_windows": sliding_windows(hf),
        "eos_token_ids": eos_ids(getattr(hf, "eos_token_id", None)),
    }
    fields.update(parts)
    return ModelConfig(**fields)


def grouped_sigmoid_moe(hf: Any) -> MoeSpec:
    """DeepSeek-V3's mixture of experts (GLM-4.5 shares it): sigmoid scores plus a correction
    bias pick the top-k within the ``topk_group`` best of ``n_group`` groups, weights
    renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; dense MLPs on
    the first ``first_k_dense_replace`` layers; ungated shared experts beside the routed ones."""
    experts = int(getattr(hf, "n_routed_experts", None) or hf.num_local_experts)
    router = RouterSpec(
        experts,
        int(hf.num_experts_per_tok),
        scoring=Scoring.SIGMOID,
        renormalize=bool(hf.norm_topk_prob),
        correction_bias=True,
        num_groups=int(hf.n_group),
        topk_groups=int(hf.topk_group),
        scaling_factor=float(hf.routed_scaling_factor),
    )
    width = int(hf.moe_intermediate_size)
    dense = int(getattr(hf, "first_k_dense_replace", 0) or 0)
    return MoeSpec(
        router,
        width,
        tuple(i >= dense for i in range(int(hf.num_hidden_layers))),
        shared_intermediate_size=width * int(getattr(hf, "n_shared_experts", 0) or 0),
        names=MoeNames(shared="mlp.shared_experts"),
    )
