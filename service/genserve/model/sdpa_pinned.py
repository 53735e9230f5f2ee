"""SDPA with its backend fixed, for the ``--gpu-prefill-attention sdpa-pinned`` path.

Why: ``F.scaled_dot_product_attention`` picks a backend per call.  On Hopper a recent torch
may pick cuDNN attention, which builds an execution plan for every new shape (a step's
prompt lengths change every step), and a GQA call (``enable_gqa``) may fall to the math
backend, dozens of small kernels.  Both are host time per call, and that is what the
eager mixed steps were measured to spend most of their time in (issue #29).  Pinned: whole
prompts (causal, no mask) go to flash attention (memory-efficient where flash cannot take
the dtype, e.g. float32), chunks with a mask to memory-efficient attention, and K/V are
expanded to the query heads beforehand so no backend needs GQA support.  On the CPU the
backends stay torch's choice (this path is for CUDA; the CPU has its own kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_CAUSAL = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
_MASKED = [SDPBackend.EFFICIENT_ATTENTION]


@contextlib.contextmanager
def pinned(device: torch.device, masked: bool) -> Iterator[None]:
    """SDPA calls inside run flash/efficient attention only (``masked``: efficient only)."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(_MASKED if masked else _CAUSAL):
        yield


def expand_kv(x: torch.Tensor, num_heads: int, head_dim_axis: int = -3) -> torch.Tensor:
    """``x`` with its KV-head axis (``head_dim_axis``) repeated to ``num_heads`` (each KV
    head for its group of consecutive query heads), or ``x`` itself without GQA."""
    kv_heads = x.shape[head_dim_axis]
    if kv_heads == num_heads:
        return x
    return x.repeat_interleave(num_heads // kv_heads, dim=head_dim_axis)
