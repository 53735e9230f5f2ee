"""Which attention backend serves a device, dtype and block size (one decision, at start-up).

:mod:`genserve.model.attention` defines the contracts and the torch backend,
:mod:`genserve.model.flash_attention` the flash-attn one; the runner asks here.
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import torch

from genserve.model.attention import (
    AttentionBackend,
    PrefillAttention,
    TorchPagedAttention,
)
from genserve.model.flash_attention import FlashPagedAttention
from genserve.model.step_upload import Upload

# --gpu-prefill-attention: how a CUDA step with prompt rows attends (docs/gpu-step.md).
PrefillAttentionFlag = Literal["auto", "triton", "sdpa", "sdpa-pinned"]


def triton_prefill_unusable(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int
) -> str | None:
    """Why the Triton whole-step kernel (``kernels/triton_varlen_attention``) cannot serve
    these options, or None when it can."""
    from genserve.kernels import triton_varlen_attention

    if device.type != "cuda":
        return f"it serves CUDA devices (this one is {device.type})"
    if not triton_varlen_attention.available(device):
        return "Triton >= 3.0 is not installed"
    if not triton_varlen_attention.supports(block_size, head_dim):
        return (
            f"block size {block_size} / head size {head_dim} "
            "(needs a power of two >= 16 / at most 256)"
        )
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    return None


def resolve_prefill_attention(
    flag: PrefillAttentionFlag,
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    head_dim: int,
    model_supported: bool = True,
) -> PrefillAttention:
    """The ``--gpu-prefill-attention`` value in force.  ``auto``: the Triton kernel where it
    runs for these options, else plain SDPA (the path measured before; ``sdpa-pinned`` is
    asked for explicitly until a GPU has compared them).  ``triton`` where the kernel cannot
    run is refused (ValueError), not silently replaced.  Off CUDA every value means the
    default path (the CPU has its own kernels).  ``model_supported``: False for attention
    the kernel does not implement (latent attention, the transformers fallback)."""
    if device.type != "cuda":
        if flag == "triton":
            raise ValueError("--gpu-prefill-attention triton: the kernel serves CUDA devices only")
        return "sdpa"
    reason = triton_prefill_unusable(device, block_size, dtype, head_dim)
    if reason is None and not model_supported:
        reason = "this model's attention (latent attention or the transformers fallback)"
    if flag == "triton":
        if reason is not None:
            raise ValueError(f"--gpu-prefill-attention triton cannot run here: {reason}")
        return "triton"
    if flag == "auto":
        return "triton" if reason is None else "sdpa"
    return flag


def select_backend(
    device: torch.device,
    block_size: int,
    dtype: torch.dtype,
    head_dim: int = 128,
    prefill: PrefillAttention = "sdpa",
    upload: Upload | None = None,
) -> AttentionBackend:
    """flash-attn when it can run (CUDA, importable, half precision, a block size its paged
    kernels accept), else the torch backend — with genserve's CPU decode kernel on CPU
    when it builds (``genserve.kernels.cpu``), and on CUDA with genserve's
    Triton decode kernel (``genserve.kernels.triton_attention``) when Triton is installed.
    ``prefill`` (:func:`resolve_prefill_attention`) and ``upload`` go to the torch backend;
    flash-attn attends a whole step in one varlen call already."""
    if (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and block_size % 256 == 0
        and importlib.util.find_spec("flash_attn") is not None
    ):
        return FlashPagedAttention(device)
    from genserve.kernels import cpu as cpu_kernels
    from genserve.kernels import triton_attention

    triton_decode = (
        device.type == "cuda"
        and triton_attention.available(device)
        and triton_attention.supports(block_size, head_dim)
    )
    return TorchPagedAttention(
        device,
        use_cpu_kernel=cpu_kernels.usable(device, dtype),
        use_triton_decode=triton_decode,
        per_token=cpu_kernels.batch_invariant(),
        prefill=prefill,
        upload=upload,
    )
