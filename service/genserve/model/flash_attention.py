"""The CUDA attention backend on flash-attn's paged varlen kernel: one call per layer per step.

Chosen by :mod:`genserve.model.attention_backend` on CUDA when ``flash_attn`` imports, the
dtype is float16/bfloat16 and the block size a multiple of 256 (what its paged kernels
take).  Cache per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; one
``flash_attn_varlen_func`` call with ``block_table`` attends the whole batch (its causal
masks are bottom-right aligned, which is what chunked prefill needs).  It implements the
contracts of :mod:`genserve.model.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from genserve.kernels.triton_rotary_kv import BLOCKS_FIRST
from genserve.model.attention import AttentionMetadata, SeqSpec, block_table, slot_mapping


@dataclass(slots=True)
class FlashAttentionMetadata:
    slots: torch.Tensor  # [num_tokens] int64
    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32, cumulative context lengths
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    rotary_lens: torch.Tensor  # [num_tokens] int64 (SeqSpec.rotary_lens)

    @property
    def fused_kv_slots(self) -> torch.Tensor | None:
        return None  # a CUDA layout: write_kv stores K/V

    @property
    def kv_layout(self) -> int:
        return BLOCKS_FIRST

    def sequence_lengths(self) -> torch.Tensor:
        return self.rotary_lens

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # kv_cache: [2, num_blocks, block_size, kv_heads, head_dim]
        two, num_blocks, block_size, heads, head_dim = kv_cache.shape
        flat = kv_cache.view(two, num_blocks * block_size, heads, head_dim)
        flat[0].index_copy_(0, self.slots, k)
        flat[1].index_copy_(0, self.slots, v)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]

        if sinks is not None:  # the model runner picks the torch backend for such models
            raise ValueError("flash-attn's paged kernel has no attention sinks")

        num_tokens, num_heads, head_dim = q.shape
        out = flash_attn_varlen_func(
            q,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            # HF's sliding window keeps keys with q_pos - k_pos < window.
            window_size=(window - 1, 0) if window is not None else (-1, -1),
            softcap=0.0 if softcap is None else softcap,
            block_table=self.block_table,
        )
        return out.reshape(num_tokens, num_heads * head_dim)  # type: ignore[no-any-return]


class FlashPagedAttention:
    """CUDA backend on flash-attn's paged varlen kernel (one call per layer per step)."""

    name = "flash-attn"
    block_dim = 1

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def build(self, seqs: list[SeqSpec], num_decodes: int, block_size: int) -> AttentionMetadata:
        dev = self.device
        q_lens = np.asarray([s.num_tokens for s in seqs], dtype=np.int32)
        k_lens = np.asarray([s.context_len for s in seqs], dtype=np.int32)
        cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
        table, _ = block_table(seqs, block_size)
        rotary = np.concatenate([s.rotary_lens() for s in seqs]) if seqs else np.zeros(0, np.int64)
        return FlashAttentionMetadata(
            slots=torch.from_numpy(slot_mapping(seqs, num_decodes, block_size)).to(dev),
            cu_seqlens_q=torch.from_numpy(cu_q).to(dev),
            cu_seqlens_k=torch.from_numpy(cu_k).to(dev),
            max_seqlen_q=int(q_lens.max(initial=0)),
            max_seqlen_k=int(k_lens.max(initial=0)),
            block_table=torch.from_numpy(table.astype(np.int32)).to(dev),
            rotary_lens=torch.from_numpy(rotary).to(dev),
        )
