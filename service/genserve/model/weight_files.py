"""Which files of a checkpoint directory are the model's weights.

Only what transformers itself reads as weights counts: ``model.safetensors.index.json`` (and
the shards it names) or ``model*.safetensors``.  Anything else that happens to end in
``.safetensors`` — a cache genserve or another tool keeps beside the weights, an adapter, a
consolidated copy — is never read as model weights, so a damaged or foreign file there cannot
stop a start.  Imports nothing heavy: the loader uses it before torch is imported.
"""

from __future__ import annotations

import json
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[str]:
    """The safetensors files holding ``model_dir``'s weights (names relative to it), in a
    stable order; empty when it has none.  Raises ValueError for an unreadable index."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a safetensors index: {exc}") from exc
        return sorted(set(map(str, weight_map.values())))
    return sorted(p.name for p in model_dir.glob("model*.safetensors") if p.is_file())


def has_weights(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds safetensors model weights (see :func:`weight_files`)."""
    return (model_dir / INDEX_FILE).is_file() or any(model_dir.glob("model*.safetensors"))
