"""gpt-oss's released Hugging Face checkpoints (``quantization_config: mxfp4``): their routed
experts' MXFP4 blocks and scales rearranged, losslessly, into GGML's MXFP4 blocks (type 39),
which the quantized expert op (``genserve::moe_experts_gguf``) reads natively: what
llama.cpp's converter does (``conversion/gpt_oss.py``'s ``repack_mxfp4``), done at load.

The checkpoint stores, per projection, ``*_blocks`` uint8 ``[E, rows, K / 32, 16]`` (byte
``k`` of a block holds weights ``2k`` in its low nibble and ``2k + 1`` in its high one, as
transformers' ``convert_moe_packed_tensors`` reads them) and ``*_scales`` uint8
``[E, rows, K / 32]`` (an E8M0 exponent ``s``: weight = e2m1 value · 2^(s - 127)).  A GGML
block is the same exponent byte followed by 16 bytes in which byte ``k`` holds weights ``k``
(low) and ``k + 16`` (high), valued as the doubled e2m1 table times 2^(e - 128): the same
numbers.  ``gate_up_proj``'s rows alternate gate (``2j``) and up (``2j + 1``), as in the
float checkpoints; they are split here as the converter splits them.
"""

from __future__ import annotations

import torch

BLOCK = 32
MXFP4 = "MXFP4"


def ggml_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Hugging Face MXFP4 ``blocks [..., rows, K/32, 16]`` and ``scales [..., rows, K/32]``
    (uint8) → GGML MXFP4 rows ``[..., rows, K/32 · 17]`` (uint8)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError("MXFP4 blocks and scales must be uint8")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match"
        )
    # [..., 16, 2]: weights 2k, 2k + 1 → [..., 32] in order, then bytes k | k + 16.
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)
    packed = nibbles[..., : BLOCK // 2] | (nibbles[..., BLOCK // 2 :] << 4)
    out = torch.cat((scales.unsqueeze(-1), packed), dim=-1)  # [..., rows, K/32, 17]
    return out.flatten(-2).contiguous()


def expert_stacks(
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's experts as GGML MXFP4 stacks ``(gate [E, I, H/32·17], up [E, I, ...],
    down [E, H, I/32·17])``, gate and up split from the interleaved rows."""
    gate_up = ggml_blocks(gate_up_blocks, gate_up_scales)  # [E, 2I, H/32 · 17]
    down = ggml_blocks(down_blocks, down_scales)
    return gate_up[:, 0::2].contiguous(), gate_up[:, 1::2].contiguous(), down
