"""Deriving the limits the launcher did not set, as TGI does, and checking they fit together."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from genserve.config import Config

log = structlog.get_logger(__name__)


class LimitsError(ValueError):
    """The configured limits cannot work together; the message says which flag to change."""


@dataclass(frozen=True, slots=True)
class ServingLimits:
    max_input_tokens: int
    max_total_tokens: int
    max_batch_prefill_tokens: int
    chunked_prefill_size: int
    block_size: int
    num_kv_blocks: int
    # What lowered max_input/max_total_tokens below their defaults (None: nothing did), for
    # the log and for the messages of requests refused by those limits.
    lowered_by: str | None = None
    # What set num_kv_blocks: "--max-batch-total-tokens", "limits" (kv_requests() requests
    # at full length fit) or "memory" (the memory budget allowed fewer blocks than that).
    kv_sized_by: str = "limits"
    # Blocks the limits ask for (see :func:`kv_blocks_needed`) and the full-length requests
    # that counts (:func:`kv_requests`).
    kv_blocks_needed: int = 0
    kv_requests: int = 0

    @property
    def max_batch_total_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


def token_limits(config: Config, max_position_embeddings: int | None) -> tuple[int, int]:
    """(max_input_tokens, max_total_tokens): TGI's defaults are min(max_pos, 4096) total and
    one less for the input."""
    model_max = max_position_embeddings or 4096
    total = config.max_total_tokens
    if total is None:
        total = min(model_max, 4096)
        if config.max_input_tokens is not None:
            total = max(total, config.max_input_tokens + 1)
    inputs = config.max_input_tokens if config.max_input_tokens is not None else total - 1
    if inputs < 1:
        raise LimitsError(
            f"--max-total-tokens ({total}) leaves no room for a prompt: it counts the prompt "
            "and the generated tokens together, so it must be at least 2"
            if config.max_input_tokens is None
            else f"--max-input-tokens ({inputs}) must be at least 1"
        )
    if inputs >= total:
        raise LimitsError(f"--max-input-tokens ({inputs}) must be < --max-total-tokens ({total})")
    if max_position_embeddings is not None and total > max_position_embeddings:
        raise LimitsError(
            f"--max-total-tokens ({total}) exceeds the model's max_position_embeddings "
            f"({max_position_embeddings})"
        )
    return inputs, total


# On CPU, without --max-batch-size: how many requests at --max-total-tokens the default KV
# cache holds (llama-server's default is a few slots sharing one 4,096-token context).  TGI's
# --max-concurrent-requests default of 128 is an admission limit: 128 x 4,096 tokens is
# 16 GiB of KV for a 1B model, so the memory budget (30% of free RAM) set the cache, which a
# CPU serves far fewer streams than.  Shorter requests still run more than this many at once
# (the cache is shared block by block), and the scheduler preempts when it is full.
CPU_DEFAULT_KV_REQUESTS = 8


def kv_requests(config: Config, on_cuda: bool) -> int:
    """Requests at full length the KV cache is sized for: every one the scheduler may run at
    once (the lesser of --max-concurrent-requests and --max-batch-size); on CPU without
    --max-batch-size, at most :data:`CPU_DEFAULT_KV_REQUESTS`."""
    running = config.max_concurrent_requests
    if config.max_batch_size is not None:
        running = min(running, config.max_batch_size)
    elif not on_cuda:
        running = min(running, CPU_DEFAULT_KV_REQUESTS)
    return running


def kv_blocks_needed(config: Config, max_total_tokens: int, on_cuda: bool = True) -> int:
    """KV blocks the limits ask for: :func:`kv_requests` requests at --max-total-tokens, plus
    the draft slots --speculate reserves per sequence.  (On CUDA, and on CPU with
    --max-batch-size, every request the scheduler may run at once: a larger cache is memory
    nobody can use.)"""
    per_request = -(-(max_total_tokens + config.speculate) // config.block_size)
    return kv_requests(config, on_cuda) * per_request


def derive_limits(
    config: Config,
    max_position_embeddings: int | None,
    memory_num_blocks: int,
    on_cuda: bool,
) -> ServingLimits:
    """``memory_num_blocks``: how many KV blocks fit the memory budget; used when
    --max-batch-total-tokens is not given."""
    max_input, max_total = token_limits(config, max_position_embeddings)
    block_size = config.block_size
    needed = kv_blocks_needed(config, max_total, on_cuda)
    if config.max_batch_total_tokens is not None:
        num_blocks = -(-config.max_batch_total_tokens // block_size)
        sized_by = "--max-batch-total-tokens"
    else:
        # Sized from what the limits can use, the memory budget only capping it.
        num_blocks = min(memory_num_blocks, needed)
        sized_by = "limits" if num_blocks == needed else "memory"
    capacity = num_blocks * block_size
    lowered_by = None
    if capacity < max_total:
        if config.max_total_tokens is None and config.max_input_tokens is None:
            # Nothing was asked explicitly: shrink the per-request limits to what fits, and
            # say so, naming the cause (a request refused later cites it too).
            lowered_by = (
                f"--max-batch-total-tokens={config.max_batch_total_tokens}"
                if config.max_batch_total_tokens is not None
                else "free memory (--cuda-memory-fraction)"
                if on_cuda
                else "free memory (--cpu-memory-fraction)"
            )
            log.warning(
                "limits_lowered",
                max_total_tokens=capacity,
                max_input_tokens=capacity - 1,
                default_max_total_tokens=max_total,
                cause=lowered_by,
                detail=f"the KV cache holds {capacity} tokens, fewer than one request's "
                f"default {max_total}: raise {lowered_by.split('=')[0]} or set --max-total-tokens",
            )
            max_total = capacity
            max_input = max_total - 1
        else:
            raise LimitsError(
                f"the KV cache holds {capacity} tokens (--max-batch-total-tokens / free "
                f"memory) but one request may need --max-total-tokens={max_total}: lower "
                "--max-total-tokens or raise --max-batch-total-tokens"
            )
    if max_input < 1:
        raise LimitsError(f"the KV cache ({capacity} tokens) is too small to serve anything")
    prefill = config.max_batch_prefill_tokens
    if prefill is None:
        prefill = max_input + 50
    if config.disable_chunked_prefill and prefill < max_input:
        raise LimitsError(
            f"without chunked prefill a whole prompt is computed in one step: "
            f"--max-batch-prefill-tokens ({prefill}) must be >= --max-input-tokens ({max_input})"
        )
    chunk = config.chunked_prefill_size
    if chunk is None:
        # On a CPU a long chunk stalls every running stream for its whole duration: keep
        # chunks short so decodes keep flowing (GPUs amortise far larger chunks).
        chunk = prefill if on_cuda else min(prefill, 256)
    chunk = min(chunk, prefill)
    return ServingLimits(
        max_input_tokens=max_input,
        max_total_tokens=max_total,
        max_batch_prefill_tokens=prefill,
        chunked_prefill_size=chunk,
        block_size=block_size,
        num_kv_blocks=num_blocks,
        lowered_by=lowered_by,
        kv_sized_by=sized_by,
        kv_blocks_needed=needed,
        kv_requests=kv_requests(config, on_cuda),
    )
