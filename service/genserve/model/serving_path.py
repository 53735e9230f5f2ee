"""Which implementation serves a checkpoint: genserve's native model, or transformers'.

Three paths, decided from ``config.json`` alone (cheap: no weights are read):

- ``native``: the architecture is one of the native families (``model/families``) and its
  config reduces to a spec the native model builds (``load_model_config`` accepts it, and
  the rotary code has its rope kind).  Everything the server has (fused CPU kernels,
  quantization, sharding, LoRA, CUDA graphs) applies.
- ``transformers``: any other ``*ForCausalLM`` whose attention goes through transformers'
  attention interface (``_supports_attention_backend``) and whose layers are all attention
  layers: transformers' modeling code runs with genserve's paged KV cache and continuous
  batching (``model/transformers_backend.py``).
- ``transformers-sequential``: a causal LM with recurrent or hybrid layers (Mamba, gated
  DeltaNet, ...) or attention outside the interface: per-sequence state lives outside the
  paged cache, so each sequence runs with transformers' own cache, one at a time.

A config that maps to no causal-LM class raises :class:`UnsupportedModelError` naming both
refusals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from genserve.model.config import ModelConfig, UnsupportedModelError, load_model_config

NATIVE = "native"
TRANSFORMERS = "transformers"
TRANSFORMERS_SEQUENTIAL = "transformers-sequential"

# transformers' ``layer_types`` values whose layers are attention over the past K/V only.
_ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention"}
)


@dataclass(frozen=True, slots=True)
class ServingPath:
    """How ``architecture`` is served; ``reason`` says why (logged and documented)."""

    architecture: str
    implementation: str  # NATIVE | TRANSFORMERS | TRANSFORMERS_SEQUENTIAL
    reason: str

    @property
    def is_native(self) -> bool:
        return self.implementation == NATIVE

    @property
    def per_request_state(self) -> bool:
        """Whether each sequence keeps state outside the paged KV cache."""
        return self.implementation == TRANSFORMERS_SEQUENTIAL


def choose_serving_path(
    model_dir: Path,
    trust_remote_code: bool = False,
    model_impl: str = "auto",
    memo_dir: Path | None = None,
) -> ServingPath:
    """The path for ``model_dir/config.json``; raises :class:`UnsupportedModelError` when
    neither the native models nor transformers' causal-LM classes can serve it.
    ``model_impl="transformers"`` skips the native models.  ``memo_dir``: where the native
    spec is remembered (``model/derived_memo.py``)."""
    if model_impl not in ("auto", "transformers"):
        raise UnsupportedModelError(f"unknown model implementation {model_impl!r}")
    native_refusal = "--model-impl transformers"
    try:
        if model_impl == "auto":
            native = load_model_config(model_dir, trust_remote_code, memo_dir)
            _check_native_build(native)
            _check_native_weights(native, model_dir)
            return ServingPath(native.architecture, NATIVE, "implemented natively")
    except UnsupportedModelError as exc:
        native_refusal = str(exc)
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    cls = causal_lm_class(hf, model_dir, trust_remote_code)
    archs: list[str] = list(getattr(hf, "architectures", None) or [])
    model_type = str(getattr(hf, "model_type", "?"))
    if cls is None:
        raise UnsupportedModelError(
            f"{native_refusal}; and transformers has no causal-LM class for "
            f"{archs or model_type!r} (model_type {model_type!r}), so the transformers "
            "fallback cannot serve it either"
        )
    architecture = archs[0] if archs else cls.__name__
    recurrent = recurrent_layer_types(hf)
    if recurrent:
        reason = f"layers {sorted(recurrent)} keep per-sequence state outside the paged cache"
        return ServingPath(architecture, TRANSFORMERS_SEQUENTIAL, reason)
    if not getattr(cls, "_supports_attention_backend", False):
        reason = f"{cls.__name__} does not use transformers' attention interface"
        return ServingPath(architecture, TRANSFORMERS_SEQUENTIAL, reason)
    if getattr(hf, "attn_temperature_tuning", False) and getattr(hf, "no_rope_layers", None):
        # Llama-4 scales no-rope queries by the index in the forward's input, not by
        # position_ids: exact only with one sequence per forward and transformers' cache.
        reason = "attention temperature tuning is computed from the input index"
        return ServingPath(architecture, TRANSFORMERS_SEQUENTIAL, reason)
    return ServingPath(architecture, TRANSFORMERS, f"not native: {native_refusal}")


def _check_native_build(config: ModelConfig) -> None:
    """Raise :class:`UnsupportedModelError` for what the family's config reduction accepts but
    building the native model would refuse (a rope kind or rotary layout the rotary code
    lacks), so such a model takes the fallback instead of failing at load."""
    from genserve.model.rotary import head_permutation, rope_inv_freq

    attn = config.attention
    for rope in (config.rope, config.local_rope):
        if rope is not None:
            rope_inv_freq(rope, attn.rotary_dim or config.head_dim)
    head_permutation(config.head_dim, attn.rotary_dim or config.head_dim, attn.interleaved_rotary)


def _check_native_weights(config: ModelConfig, model_dir: Path) -> None:
    """Raise :class:`UnsupportedModelError` where the native model could not read the
    weights, so the model goes to the fallback (transformers dequantizes the file) instead
    of failing at load: a GGUF of an architecture whose llama.cpp tensor layout
    ``gguf_names`` does not map (e.g. ``stablelm``, ``starcoder2``), a mixture-of-experts
    GGUF of an architecture without an expert mapping (``qwen2moe``, ``qwen3moe`` and
    ``llama``, Mixtral's, have one), a GGUF with fused gate/up expert stacks, and a GGUF with
    experts (``{arch}.expert_count``) whose config was read as a dense model."""
    from genserve.model import gguf_names
    from genserve.model.gguf_index import GGUFIndex
    from genserve.model.loader import transformers_weights_kwargs

    gguf_file = transformers_weights_kwargs(model_dir).get("gguf_file")
    if gguf_file is None:
        return
    index = GGUFIndex(gguf_file)
    fields = index.fields
    field = fields.get("general.architecture")
    arch = None if field is None else field.contents()
    layout = gguf_names.layout(arch)
    if layout is None:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not read natively (native GGUF layouts: "
            f"{sorted(gguf_names.LAYOUTS)})"
        )
    experts = fields.get(f"{arch}.expert_count")
    num_experts = None if experts is None else experts.contents()
    if config.moe is not None and not layout.experts:
        raise UnsupportedModelError(
            f"the native reader has no mixture-of-experts tensors for GGUF architecture {arch!r}"
        )
    if any(".ffn_gate_up_exps." in t.name for t in index.tensors):
        raise UnsupportedModelError(
            "the GGUF file's experts are fused gate/up stacks (ffn_gate_up_exps, the "
            "converter's --fuse-gate-up-exps), which the native reader does not split"
        )
    if config.moe is None and isinstance(num_experts, int) and num_experts > 0:
        raise UnsupportedModelError(
            f"the GGUF file has {num_experts} experts per layer but its config was read as "
            f"a dense {config.architecture}"
        )


def causal_lm_class(hf: Any, model_dir: Path, trust_remote_code: bool) -> type | None:
    """The ``AutoModelForCausalLM`` class for config ``hf``, or None."""
    from transformers import AutoModelForCausalLM

    auto_map = getattr(hf, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        remote: type = get_class_from_dynamic_module(
            auto_map["AutoModelForCausalLM"], str(model_dir)
        )
        return remote
    try:
        cls: type = AutoModelForCausalLM._model_mapping[type(hf)]
    except KeyError:
        return None
    return cls


def recurrent_layer_types(hf: Any) -> set[str]:
    """Layer kinds of ``hf`` that are not attention (empty: attention only)."""
    kinds: set[str] = set()
    for attr in ("layer_types", "layers_block_type"):
        value = getattr(hf, attr, None)
        if isinstance(value, list | tuple):
            kinds |= {str(v) for v in value}
    return kinds - _ATTENTION_LAYER_TYPES
