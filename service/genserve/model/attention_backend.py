"""Which attention backend serves a device, dtype and block size (one decision, at start-up).

:mod:`genserve.model.attention` defines the contracts and the torch backend,
:mod:`genserve.model.flash_attention` the flash-attn one; the runner asks here.
"""

from __future__ import annotations

import importlib.util

import torch

from genserve.model.attention import AttentionBackend, TorchPagedAttention
from genserve.model.flash_attention import FlashPagedAttention


def select_backend(
    device: torch.device, block_size: int, dtype: torch.dtype, head_dim: int = 128
) -> AttentionBackend:
    """flash-attn when it can run (CUDA, importable, half precision, a block size its paged
    kernels accept), else the torch backend — with genserve's CPU decode kernel on CPU
    when it builds (``genserve.kernels.cpu``), and on CUDA with genserve's
    Triton decode kernel (``genserve.kernels.triton_attention``) when Triton is installed."""
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
    )
