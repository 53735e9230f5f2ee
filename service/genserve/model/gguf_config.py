"""Hyperparameters llama.cpp writes into a GGUF file that transformers' GGUF config reader
(``integrations/ggml.py``'s ``GGUF_CONFIG_MAPPING``) drops, read back so that the config
genserve keeps for a GGUF model describes the model llama.cpp would run.

Without them a Qwen3 file gets transformers' default ``head_dim`` (128, whatever the file
says), a Gemma 2 file the default soft-caps, a Phi-3 file no sliding window and full
rotary, and Gemma 2/3 the default ``query_pre_attn_scalar`` (256) where llama.cpp scales
queries by ``head_dim`` (the hidden size per head for the 27B models: ``src/models/gemma2.cpp``),
and a Qwen2/3-MoE file transformers' default expert widths (768 routed, 5632 shared).

A ``gpt-oss`` file's YaRN keys (``gpt-oss.rope.scaling.*``) are hidden from transformers
(:data:`HIDDEN_FROM_TRANSFORMERS`): its gpt-oss branch of ``load_gguf_checkpoint`` (5.24)
reads each value as ``field.parts[0]``, the key's length, and fails on it; they are read here
instead (:func:`apply_llama_cpp_hparams`).

A Mixtral file is written by llama.cpp as ``llama`` with ``llama.expert_count``: transformers
reads it as a dense ``LlamaConfig`` (its ``llama`` mapping has no expert keys), and
:func:`mixtral_from_llama` turns that into the ``MixtralConfig`` llama.cpp runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Metadata transformers' GGUF config reader must not see (see the module docstring): without
# the type key its gpt-oss branch reads nothing, and _gpt_oss_rope restores the rope.
HIDDEN_FROM_TRANSFORMERS = frozenset({"gpt-oss.rope.scaling.type"})

# llama.cpp's layer counts of the 27B Gemma 2 / Gemma 3 (its LLM_TYPE_27B).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _scalar(fields: Any, key: str) -> Any:
    field = fields.get(key)
    return None if field is None else field.contents()


def mixtral_from_llama(gguf_file: Path, config: Any) -> Any:
    """``config`` (transformers' reading of ``gguf_file``) as a ``MixtralConfig`` when the
    file is a ``llama`` with experts (how ``convert_hf_to_gguf.py`` writes Mixtral), else
    ``config`` itself.  The model is the one llama.cpp's ``llama`` graph runs: softmax top-k
    of ``expert_count`` experts, renormalised, SiLU-gated experts of width
    ``expert_feed_forward_length`` (else ``feed_forward_length``), full attention (the
    ``llama`` graph has no sliding window, and the converter writes none for Mixtral).

    Raises ValueError for an expert layout llama.cpp's ``llama`` graph runs but Mixtral's
    does not (Granite-MoE's shared expert, ``expert_shared_feed_forward_length``)."""
    from transformers import MixtralConfig

    from genserve.model.gguf_index import GGUFIndex

    fields = GGUFIndex(gguf_file).fields
    experts = _scalar(fields, "llama.expert_count")
    if _scalar(fields, "general.architecture") != "llama" or not experts:
        return config
    if _scalar(fields, "llama.expert_shared_feed_forward_length"):
        raise ValueError("a llama GGUF with a shared expert (Granite-MoE) is not Mixtral")
    width = _scalar(fields, "llama.expert_feed_forward_length") or config.intermediate_size
    kept = (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
        "rope_parameters", "tie_word_embeddings", "bos_token_id", "eos_token_id",
        "pad_token_id",
    )  # fmt: skip
    values = {k: getattr(config, k) for k in kept if getattr(config, k, None) is not None}
    return MixtralConfig(
        **values,
        intermediate_size=int(width),
        num_local_experts=int(experts),
        num_experts_per_tok=int(_scalar(fields, "llama.expert_used_count") or 2),
        sliding_window=None,
        hidden_act="silu",
        architectures=["MixtralForCausalLM"],
    )


def apply_llama_cpp_hparams(gguf_file: Path, config: Any) -> dict[str, Any]:
    """Set on ``config`` (read from ``gguf_file`` by transformers) the fields the file's
    llama.cpp metadata gives and transformers dropped; only fields ``config`` has.  Returns
    what was set (transformers names), for the log."""
    from genserve.model.gguf_index import GGUFIndex

    # The index reads scalars and tensor records without parsing the vocabulary arrays
    # (gguf.GGUFReader made a numpy view per string: most of a minute at 8B).
    reader = GGUFIndex(gguf_file)
    fields = reader.fields
    arch = _scalar(fields, "general.architecture")
    if not isinstance(arch, str):
        return {}
    out: dict[str, Any] = {}
    keys = {
        "head_dim": f"{arch}.attention.key_length",
        "sliding_window": f"{arch}.attention.sliding_window",
        "attn_logit_softcapping": f"{arch}.attn_logit_softcapping",
        "final_logit_softcapping": f"{arch}.final_logit_softcapping",
        # Mixtures of experts (qwen2moe, qwen3moe): transformers' reader keeps the expert
        # count and top-k but drops the widths, leaving its defaults.
        "moe_intermediate_size": f"{arch}.expert_feed_forward_length",
        "shared_expert_intermediate_size": f"{arch}.expert_shared_feed_forward_length",
    }
    for name, key in keys.items():
        value = _scalar(fields, key)
        if value is not None and hasattr(config, name):
            out[name] = value
    if out.get("sliding_window") == 0:  # llama.cpp's Phi-3 writes 0 for none (Phi-4)
        out["sliding_window"] = None
    heads = getattr(config, "num_attention_heads", None) or 1
    head_dim = out.get("head_dim") or getattr(config, "head_dim", None)
    head_dim = head_dim or config.hidden_size // heads
    if arch in _GEMMA_27B_LAYERS and hasattr(config, "query_pre_attn_scalar"):
        big = getattr(config, "num_hidden_layers", 0) == _GEMMA_27B_LAYERS[arch]
        out["query_pre_attn_scalar"] = config.hidden_size // heads if big else head_dim
    for name, value in out.items():
        setattr(config, name, value)
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        if arch == "phi3":
            out.update(_phi3_rope(reader, fields, config, params, head_dim))
        elif arch == "gemma3":
            out.update(_gemma3_rope(fields, params))
        elif arch == "gpt-oss":
            out.update(_gpt_oss_rope(fields, params))
    return out


def _gpt_oss_rope(fields: Any, params: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's YaRN (``rope.scaling.type``, ``factor``, ``original_context_length``,
    ``yarn_beta_fast``/``yarn_beta_slow``, as ``convert_hf_to_gguf.py`` writes them) into
    ``rope_parameters``.  ``truncate`` keeps ``GptOssConfig``'s default, False, as the
    released checkpoints have it (the file does not record it); llama.cpp's YaRN rounds the
    correction range to whole dimensions (``ggml_rope_yarn_corr_dims``' floor/ceil), i.e.
    computes gpt-oss's rotary slightly otherwise than transformers does."""
    kind = _scalar(fields, "gpt-oss.rope.scaling.type")
    if kind != "yarn":
        return {}
    out: dict[str, Any] = {"rope_type": "yarn"}
    keys = {
        "factor": "factor",
        "original_max_position_embeddings": "original_context_length",
        "beta_fast": "yarn_beta_fast",
        "beta_slow": "yarn_beta_slow",
    }
    for name, key in keys.items():
        value = _scalar(fields, f"gpt-oss.rope.scaling.{key}")
        if value is not None:
            out[name] = int(value) if name.startswith("original") else float(value)
    params.update(out)
    return out


def _phi3_rope(
    reader: Any, fields: Any, config: Any, params: dict[str, Any], head_dim: int
) -> dict[str, Any]:
    """Partial rotary (``rope.dimension_count``) and longrope (the ``rope_factors_long`` /
    ``rope_factors_short`` tensors llama.cpp writes for 128k models) into
    ``rope_parameters``."""
    import numpy as np

    out: dict[str, Any] = {}
    rope_dims = _scalar(fields, "phi3.rope.dimension_count")
    if isinstance(rope_dims, int) and rope_dims != head_dim:
        params["partial_rotary_factor"] = out["partial_rotary_factor"] = rope_dims / head_dim
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    long, short = factors.get("rope_factors_long.weight"), factors.get("rope_factors_short.weight")
    original = _scalar(fields, "phi3.rope.scaling.original_context_length")
    if long is not None and short is not None and isinstance(original, int):
        params["rope_type"] = "longrope"
        params["long_factor"] = [float(v) for v in np.asarray(long.data).reshape(-1)]
        params["short_factor"] = [float(v) for v in np.asarray(short.data).reshape(-1)]
        params["original_max_position_embeddings"] = original
        if hasattr(config, "original_max_position_embeddings"):  # Phi-3 keeps it outside too
            config.original_max_position_embeddings = original
        out["rope_type"] = "longrope"
        out["original_max_position_embeddings"] = original
    return out


def _gemma3_rope(fields: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The global layers' rope scaling (linear, the 4B+ models) and the sliding layers' base
    into the per-layer-type ``rope_parameters``."""
    out: dict[str, Any] = {}
    full, sliding = params.get("full_attention"), params.get("sliding_attention")
    kind = _scalar(fields, "gemma3.rope.scaling.type")
    factor = _scalar(fields, "gemma3.rope.scaling.factor")
    if isinstance(full, dict) and kind == "linear" and factor:
        full.update(rope_type="linear", factor=float(factor))
        out["rope_factor"] = float(factor)
    local_base = _scalar(fields, "gemma3.rope.freq_base_swa")
    if isinstance(sliding, dict) and local_base:
        sliding["rope_theta"] = out["local_rope_theta"] = float(local_base)
    return out
