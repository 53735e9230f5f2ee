"""Native model construction: every native family is the one spec-assembled decoder."""

from __future__ import annotations

import structlog
import torch

from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.families import FAMILIES
from genserve.model.spec import ModelConfig, UnsupportedModelError
from genserve.parallel import ParallelContext

log = structlog.get_logger("genserve.model")


def build_model(
    config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: torch.device
) -> DecoderForCausalLM:
    """An uninitialised model (weights allocated, not loaded) for ``config``."""
    if config.architecture not in FAMILIES:
        raise UnsupportedModelError(f"no native implementation of {config.architecture}")
    if ctx.expert_parallel:
        _check_expert_parallel(config, ctx)
    return DecoderForCausalLM(config, ctx, dtype, device)


def _check_expert_parallel(config: ModelConfig, ctx: ParallelContext) -> None:
    """Refuse ``--expert-parallel`` for a model without routed experts (a promise the
    server could not keep); log which experts this shard holds."""
    if config.moe is None or not any(config.moe.layers):
        raise UnsupportedModelError(
            f"--expert-parallel: {config.architecture} has no mixture-of-experts layers; "
            "drop the flag (--num-shard alone splits the model by tensor parallelism)"
        )
    num_experts = config.moe.router.num_experts
    start, stop = ctx.expert_share(num_experts)
    log.info(
        "expert_parallel",
        shard=ctx.rank,
        experts=f"{start}-{stop - 1}",
        num_local_experts=stop - start,
        num_experts=num_experts,
    )
