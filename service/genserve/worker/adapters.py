"""Reading PEFT LoRA adapters and installing them into the model's LoRA slots.

An adapter is PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``) and ``adapter_model.safetensors`` with tensors named
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``….lora_B.weight``
(``[out, r]``).  It is found by id: a local directory, or (``--adapter-source hub``) a hub
id resolved in the local Hugging Face cache only (no network).  Everything is validated
against the base model before a slot is touched: a module the model lacks, a shape that
does not fit or an unreadable file raise :class:`AdapterError` naming the adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from genserve.model.config import ModelConfig
from genserve.model.lora import (
    SUPPORTED_MODULES,
    AdapterError,
    LoraHook,
    ModuleSplit,
    SlotWeights,
    StepAdapters,
    lora_scale,
    slice_pair,
)

_PEFT_PREFIX = "base_model.model."


class AdapterNotFoundError(LookupError):
    """No adapter directory (or cached hub snapshot) for this id."""


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
    :class:`~genserve.model.lora.AdapterError` (INVALID_ARGUMENT) for a directory that is
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


Targets = dict[str, tuple[LoraHook, ModuleSplit]]


@dataclass(frozen=True, slots=True)
class PreparedAdapter:
    """One adapter as this rank's per-projection slot contents (:class:`SlotWeights`, in the
    model's dtype and on its device), ready for a cheap copy into a slot."""

    adapter_id: str
    per_hook: dict[int, SlotWeights]  # id(hook) -> weights; absent: not targeted


def _hook_widths(targets: Targets) -> dict[int, int]:
    """Each hook's local output width (its pieces' rows, summed over the fused matrices)."""
    widths: dict[int, int] = {}
    for hook, split in targets.values():
        rows = sum(stop - start for start, stop in split.out_rows)
        widths[id(hook)] = max(widths.get(id(hook), 0), split.out_lo + rows)
    return widths


def prepare(
    adapter: AdapterWeights, targets: Targets, dtype: torch.dtype, device: torch.device
) -> PreparedAdapter:
    """Slice ``adapter`` for this rank and lay it out per projection: the A of every piece
    it adapts stacked (one shrink for q/k/v or gate/up), Bᵀ·scale block-diagonal (one
    expand writes each piece's columns).  Heavy (reads, copies, converts): run it off the
    step thread."""
    widths = _hook_widths(targets)
    pieces: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for path, (a, b, scale) in adapter.modules.items():
        hook, split = targets[path]
        a_local, b_local = slice_pair(a, b, split)
        pieces.setdefault(id(hook), []).append((split.out_lo, a_local, b_local * scale))
    per_hook: dict[int, SlotWeights] = {}
    for key, parts in pieces.items():
        parts.sort(key=lambda part: part[0])
        rank = sum(part[1].shape[0] for part in parts)
        b_block = torch.zeros(rank, widths[key], dtype=torch.float32)
        cols = torch.zeros(rank, 2, dtype=torch.int32)
        row = 0
        for lo, a_local, b_scaled in parts:
            r = a_local.shape[0]
            hi = lo + b_scaled.shape[0]
            b_block[row : row + r, lo:hi] = b_scaled.t()
            cols[row : row + r, 0] = lo
            cols[row : row + r, 1] = hi
            row += r
        a_cat = torch.cat([part[1] for part in parts], dim=0)
        per_hook[key] = SlotWeights(
            a_cat.to(device=device, dtype=dtype).contiguous(),
            b_block.to(device=device, dtype=dtype).contiguous(),
            cols.to(device=device),
        )
    return PreparedAdapter(adapter.adapter_id, per_hook)


def install(prepared: PreparedAdapter, slot: int, targets: Targets, step: StepAdapters) -> None:
    """Copy ``prepared`` into ``slot`` of every hook (replacing what the slot held): the
    cheap part, done on the step thread.  Hooks it does not target get a zero slot."""
    step.num_slots = max(step.num_slots, slot + 1)
    hooks = {id(hook): hook for hook, _ in targets.values()}
    for key, hook in hooks.items():
        hook.set_slot(slot, prepared.per_hook.get(key))
