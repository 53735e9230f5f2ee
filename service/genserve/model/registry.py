"""Native model construction: every native family is the one spec-assembled decoder."""

from __future__ import annotations

import torch

from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.families import FAMILIES
from genserve.model.spec import ModelConfig, UnsupportedModelError
from genserve.parallel import ParallelContext


def build_model(
    config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: torch.device
) -> DecoderForCausalLM:
    """An uninitialised model (weights allocated, not loaded) for ``config``."""
    if config.architecture not in FAMILIES:
        raise UnsupportedModelError(f"no native implementation of {config.architecture}")
    return DecoderForCausalLM(config, ctx, dtype, device)
