"""What the transformers fallback switches off, decided once at start-up.

A model served through transformers' modeling code (``model/serving_path.py``) runs without
genserve's native layers, so the features built on them are off:

- always: tensor parallelism (one shard), LoRA adapters, CUDA graphs, ``--quantize`` and
  genserve's fused CPU kernels for the layers (the paged decode-attention kernel still
  serves layers that fit it);
- on the sequential path (recurrent/hybrid layers), also prefix caching and speculation:
  a sequence's state is transformers' cache object, which can neither be shared between
  requests nor rolled back past rejected draft tokens.

A feature switched off by default is logged (``fallback_feature_off``) and listed in
``Info.disabled_features``; one the user asked for explicitly (``--quantize int8``,
``--lora-adapters``, ``--rope-scaling``...) is refused at start-up (exit 2), never
silently ignored.
"""

from __future__ import annotations

import dataclasses

import structlog

from genserve.config import Config
from genserve.model.config import UnsupportedModelError
from genserve.model.serving_path import ServingPath

log = structlog.get_logger("genserve")


def disabled_features(path: ServingPath) -> tuple[str, ...]:
    """``"feature: reason"`` for each feature ``path`` cannot serve (empty when native)."""
    if path.is_native:
        return ()
    off = [
        "sharding: transformers' modules are not split across shards",
        "lora: adapters attach to genserve's native layers",
        "cuda_graphs: the fallback runs eagerly",
        "quantize: quantized weights serve genserve's native layers",
        "cpu_fused_kernels: transformers' layers run as torch ops",
    ]
    if path.per_request_state:
        off += [
            "prefix_caching: per-sequence recurrent state lives outside the paged cache",
            "speculation: transformers' per-sequence cache cannot roll back rejected drafts",
        ]
    return tuple(off)


def restrict_for_fallback(config: Config, path: ServingPath) -> Config:
    """``config`` with what ``path`` cannot do switched off (logged); raises
    :class:`UnsupportedModelError` for such a feature the user asked for explicitly."""
    if path.is_native:
        return config
    asked = {
        "--quantize": config.quantize not in (None, "none"),
        "--lora-adapters/--adapter-id": bool(config.lora_adapters or config.adapter_id),
        "--rope-scaling/--rope-factor": config.rope_scaling is not None
        or config.rope_factor is not None,
        "--num-shard above 1": (config.num_shard or 1) > 1,
    }
    refused = [flag for flag, given in asked.items() if given]
    if refused:
        raise UnsupportedModelError(
            f"{path.architecture} runs through the transformers fallback ({path.reason}), "
            f"which cannot honour {', '.join(refused)}; drop the option(s) to serve it"
        )
    for feature in disabled_features(path):
        name, reason = feature.split(": ", 1)
        log.info("fallback_feature_off", feature=name, reason=reason)
    changes: dict[str, object] = {"cuda_graphs": (), "sharded": False, "num_shard": 1}
    if path.per_request_state:
        changes.update(disable_prefix_caching=True, speculate=0)
        log.warning(
            "sequential_fallback",
            architecture=path.architecture,
            reason=path.reason,
            detail="each sequence runs on its own with transformers' cache: correct, but "
            "without batching across requests (slower)",
        )
    return dataclasses.replace(config, **changes)  # type: ignore[arg-type]
