"""Reading PEFT LoRA adapters from disk and validating them against the base model.

An adapter is PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` with tensors named
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``….lora_B.weight``
(``[out, r]``).  It is found by id: a local directory, or (``--adapter-source hub``) a hub
id resolved in the local Hugging Face cache only (no network).  Everything is validated
against the base model before a slot is touched: a module the model lacks, a shape that
does not fit or an unreadable file raise :class:`AdapterError` naming the adapter.

The engine's adapter manager validates here (off the event loop); the runner reads here and
lays the weights out per slot (worker/adapters.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from genserve.model.adapter_errors import AdapterError, AdapterNotFoundError
from genserve.model.config import ModelConfig
from genserve.model.lora import SUPPORTED_MODULES, lora_scale

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter read into CPU memory: per module path, ``(A, B, scale)``."""

    adapter_id: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    base_model: str | None


def resolve_adapter_dir(
    adapter_id: str, path: str | None, source: str, hub_cache: Path | None = None
) -> Path:
    """The PEFT directory of ``adapter_id``: ``path`` (its ``--lora-adapters`` entry) or the
    id itself, probed as a local directory first; with ``--adapter-source hub`` anything
    else is a hub id looked up in the local Hugging Face cache (``hub_cache``; default: the
    hub client's, ``HF_HUB_CACHE``), never downloaded.  Raises
    :class:`AdapterNotFoundError` (NOT_FOUND) when there is nothing there and
    :class:`~genserve.model.adapter_errors.AdapterError` (INVALID_ARGUMENT) for a directory that is
    not a PEFT LoRA adapter; both name the adapter."""
    target = path or adapter_id
    local = Path(target).expanduser()
    if local.is_dir():
        directory = local
    elif source == "hub":
        directory = _hub_snapshot(adapter_id, target, hub_cache)
    else:
        raise AdapterNotFoundError(
            f"adapter {adapter_id!r}: no directory {str(local)!r} (--adapter-source local "
            "takes a directory path; hub ids need --adapter-source hub)"
        )
    if not (directory / "adapter_config.json").is_file():
        raise AdapterError(
            f"adapter {adapter_id!r}: {directory} is not a PEFT adapter (no adapter_config.json)"
        )
    return directory


def _hub_snapshot(adapter_id: str, repo_id: str, hub_cache: Path | None) -> Path:
    """The cached snapshot of hub repo ``repo_id`` (its ``main`` revision), offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        found = snapshot_download(
            repo_id,
            local_files_only=True,
            cache_dir=str(hub_cache) if hub_cache is not None else None,
        )
    except HFValidationError as exc:
        raise AdapterNotFoundError(
            f"adapter {adapter_id!r}: {repo_id!r} is neither a local directory nor a hub id ({exc})"
        ) from exc
    except Exception as exc:  # the hub client raises several kinds for "not cached"
        raise AdapterNotFoundError(
            f"adapter {adapter_id!r}: {repo_id!r} is not in the local Hugging Face cache "
            "(genserve never downloads adapters: fetch it with `huggingface-cli download`)"
        ) from exc
    return Path(found)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each adaptable module of one layer."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    return {
        "q_proj": (config.num_heads * d, h),
        "k_proj": (config.num_kv_heads * d, h),
        "v_proj": (config.num_kv_heads * d, h),
        "o_proj": (h, config.num_heads * d),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }


def read_adapter(adapter_id: str, directory: Path, config: ModelConfig) -> AdapterWeights:
    """Read and validate one adapter; raises :class:`AdapterError` naming what is wrong."""
    try:
        cfg = json.loads((directory / "adapter_config.json").read_text())
        tensors = load_file(str(directory / "adapter_model.safetensors"))
    except (OSError, ValueError, SafetensorError) as exc:
        raise AdapterError(f"adapter {adapter_id!r}: cannot read it: {exc}") from exc
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {adapter_id!r}: not a LoRA adapter config")
    if config.lora_blocker is not None:
        raise AdapterError(f"adapter {adapter_id!r}: this model takes no LoRA adapters: "
                           f"{config.lora_blocker}")  # fmt: skip
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"adapter {adapter_id!r}: rank_pattern/alpha_pattern unsupported")
    alpha = float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    shapes = expected_shapes(config)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for name, a in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        path = name.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(f"{_PEFT_PREFIX}{path}.lora_B.weight")
        short = path.rsplit(".", 1)[-1]
        parts = path.split(".")
        if short not in SUPPORTED_MODULES or b is None or len(parts) != 5:
            raise AdapterError(f"adapter {adapter_id!r}: unsupported module {path!r}")
        if not parts[2].isdigit() or int(parts[2]) >= config.num_layers:
            raise AdapterError(f"adapter {adapter_id!r}: {path!r} names no layer of the model")
        out_f, in_f = shapes[short]
        rank = a.shape[0]
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (rank, in_f)
            or (tuple(b.shape) != (out_f, rank))
        ):
            raise AdapterError(
                f"adapter {adapter_id!r}: {path} has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"the base model needs A [r, {in_f}] and B [{out_f}, r]"
            )
        modules[path] = (a, b, lora_scale(alpha, rank, rslora))
    if not modules:
        raise AdapterError(f"adapter {adapter_id!r}: no LoRA tensors in adapter_model.safetensors")
    base = cfg.get("base_model_name_or_path")
    return AdapterWeights(adapter_id, modules, base if isinstance(base, str) else None)
