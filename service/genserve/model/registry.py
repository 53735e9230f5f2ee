"""Architecture name (``config.json`` ``architectures``) → native model class."""

from __future__ import annotations

import torch

from genserve.model.config import ModelConfig, UnsupportedModelError
from genserve.model.llama import LlamaForCausalLM
from genserve.parallel import ParallelContext

# Llama, Mistral and Qwen2 differ only in configuration (biases, sliding window).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def build_model(
    config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """An uninitialised model (weights allocated, not loaded) for ``config``."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no native implementation of {config.architecture}")
    return cls(config, ctx, dtype, device)
