"""One-time preparation of checkpoints the native loader cannot read as they are, as entries
of genserve's model cache.

* GGUF: only its config and tokenizer, read from the file's metadata by transformers, are
  kept (a few MB); the weights are read from the GGUF file itself at every start.
* PyTorch ``.bin``: transformers reads it and ``save_pretrained`` writes float32
  safetensors plus the tokenizer.

Either is kept as an entry of genserve's model
cache keyed by the source's content (``model_cache``: one entry per GGUF digest, built once
even by concurrent starts, interrupted builds cleaned up).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import structlog
from tqdm import tqdm

from genserve.logging import progress_bars
from genserve.model import model_cache
from genserve.model.file_identity import file_digest
from genserve.model.gguf_config import (
    HIDDEN_FROM_TRANSFORMERS,
    apply_llama_cpp_hparams,
    mixtral_from_llama,
)
from genserve.model.gguf_metadata_reader import fast_config_reader

log = structlog.get_logger("genserve.model")


def dir_fingerprint(model_dir: Path) -> str:
    """Cheap identity of a directory of ``.bin`` weights: names, sizes and mtimes."""
    entries = sorted(
        (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model_dir.iterdir() if p.is_file()
    )
    return hashlib.sha256(json.dumps([str(model_dir.resolve()), entries]).encode()).hexdigest()


# What a GGUF entry holds (config and tokenizer from the file's metadata). Bump it whenever
# that changes, so caches written by an older genserve are rebuilt rather than served.
# 2: gguf_config restores the settings transformers' GGUF reader drops (head_dim, soft-caps,
# sliding window, Gemma's query scale, Phi-3's partial rotary and longrope factors).
# 3: and the expert widths of Qwen2/3-MoE files (moe_intermediate_size, shared expert's).
# 4: entries record their files' sizes and digests (model_cache.entry_intact), keyed by the
#    sampled digest (file_identity).
# 5: a ``llama`` file with experts (Mixtral as llama.cpp converts it) keeps a MixtralConfig.
# (Not bumped for gpt-oss files' YaRN keys, now read by gguf_config: transformers' reader
# failed on those files, so no entry of one with YaRN keys was ever written.)
GGUF_ENTRY_VERSION = 5


def convert_gguf(gguf_file: Path, cache_dir: Path, trust_remote_code: bool = False) -> Path:
    """The cache entry of ``gguf_file``'s content (built once, whatever the file is called,
    and again after an upgrade that changes what an entry holds)."""
    entry = model_cache.gguf_entry(cache_dir, file_digest(gguf_file, cache_dir))
    return model_cache.build_once(
        entry,
        lambda out: _save_gguf_metadata(gguf_file, out, trust_remote_code),
        source=str(gguf_file.resolve()),
        version=GGUF_ENTRY_VERSION,
    )


def convert_pytorch_bin(model_dir: Path, cache_dir: Path, trust_remote_code: bool = False) -> Path:
    """Re-save a ``pytorch_model*.bin`` checkpoint directory as safetensors (once)."""
    entry = model_cache.bin_entry(cache_dir, dir_fingerprint(model_dir))
    return model_cache.build_once(
        entry,
        lambda out: _save_converted(model_dir, out, trust_remote_code, gguf_file=None),
        source=str(model_dir.resolve()),
    )


class _Progress:
    """Stages of a conversion: a bar on a terminal, otherwise (``--json-output``, a log
    file) one log event per stage, so every line of output stays a log line."""

    def __init__(self, total: int, what: str) -> None:
        self._what, self._total, self._done = what, total, 0
        self._bar = (
            tqdm(total=total, desc=f"Converting {what}", unit="stage") if progress_bars() else None
        )
        self._started = time.monotonic()
        if self._bar is None:
            # transformers' own bars (reading GGUF tensors, writing shards) go too.
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()

    def stage(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(name)
        else:
            log.info(
                "model_conversion_progress",
                source=self._what,
                stage=name,
                step=self._done + 1,
                steps=self._total,
                elapsed_s=round(time.monotonic() - self._started, 2),
            )

    def advance(self) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _save_gguf_metadata(gguf_file: Path, out_dir: Path, trust_remote_code: bool) -> None:
    """``config.json`` and the tokenizer of ``gguf_file``, from its metadata (transformers
    reads them without touching a tensor).  No weights: they are read from the GGUF file
    itself at every start (model/gguf_weights.py), quantized matrices as they are stored."""
    progress = _Progress(2, gguf_file.name)
    # transformers reads the config (twice: again under AutoTokenizer) with gguf.GGUFReader;
    # the fast reader gives it the same fields without a numpy view per vocabulary string.
    with fast_config_reader(HIDDEN_FROM_TRANSFORMERS):
        _save_config_and_tokenizer(gguf_file, out_dir, trust_remote_code, progress)


def _save_config_and_tokenizer(
    gguf_file: Path, out_dir: Path, trust_remote_code: bool, progress: _Progress
) -> None:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    src, name = str(gguf_file.parent), gguf_file.name
    try:
        progress.stage("reading config")
        config = AutoConfig.from_pretrained(
            src, gguf_file=name, trust_remote_code=trust_remote_code
        )
        config = mixtral_from_llama(gguf_file, config)
        if not getattr(config, "architectures", None):
            arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
            config.architectures = [arch] if arch else None
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        restored = apply_llama_cpp_hparams(gguf_file, config)
        if restored:
            log.info("gguf_hparams_restored", source=name, fields=restored)
        config.save_pretrained(str(out_dir))
        progress.advance()
        progress.stage("reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            src, gguf_file=name, trust_remote_code=trust_remote_code
        )
        tokenizer.save_pretrained(str(out_dir))
        progress.advance()
    finally:
        progress.close()


def _save_converted(
    src_dir: Path, out_dir: Path, trust_remote_code: bool, gguf_file: str | None
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file is not None else {}
    progress = _Progress(3, gguf_file or src_dir.name)
    try:
        progress.stage("reading weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(src_dir), dtype=torch.float32, trust_remote_code=trust_remote_code, **extra
        )
        progress.advance()
        progress.stage("reading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(
            str(src_dir), trust_remote_code=trust_remote_code, **extra
        )
        progress.advance()
        progress.stage("writing safetensors")
        # A GGUF-loaded model carries a quantizer that refuses serialization although its
        # weights are already plain dequantized tensors; dropping it makes them saveable.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(out_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir))
        progress.advance()
    finally:
        progress.close()
