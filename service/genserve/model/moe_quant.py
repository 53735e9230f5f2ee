"""``--quantize int8|int4`` for a mixture of experts' routed experts: the float ``w13``/``w2``
of a safetensors checkpoint quantized after loading into GGUF blocks — Q8_0 for ``int8``,
Q4_0 for ``int4`` — so that they run on the CPU op GGUF experts already use
(``genserve::moe_experts_gguf``, float or ``--cpu-int-dot`` integer path) with no new
kernel, at 8.5 and 4.5 bits per weight (0.27x and 0.14x of float32, 0.53x and 0.28x of
bfloat16).

Blocks of 32 along each row: Q8_0 is ``d = max|w| / 127`` and ``q = round(w / d)`` (rounded
half away from zero), Q4_0 ``d = w_m / -8`` for the ``w_m`` of largest magnitude and ``q =
trunc(w / d + 8.5)`` clipped to 0..15, both with ``d`` stored as float16 — byte for byte what
gguf-py's (and so ``llama-quantize``'s) quantizers write, computed here in torch a block row
at a time.  The dense layers' ``int4`` is Q4_1-like (with a minimum, ``model/quantization.py``);
the expert op has no Q4_1 kernel, so experts take Q4_0.
"""

from __future__ import annotations

import torch

from genserve.model.moe_gguf import QuantizedExperts

BLOCK = 32
# --quantize method → the GGUF block type its experts are stored in.
EXPERT_TYPES = {"int8": "Q8_0", "int4": "Q4_0"}


def quantize_rows(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """``weight [rows, cols]`` (``cols`` a multiple of 32) → uint8 ``[rows, cols / 32 ·
    block bytes]`` in GGUF ``qtype`` (Q8_0: 34 bytes a block, Q4_0: 18), as gguf-py writes."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"{qtype} needs rows divisible by {BLOCK}, got {cols}")
    blocks = weight.detach().to(torch.float32).reshape(-1, BLOCK)  # [rows · cols/32, 32]
    if qtype == "Q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        scaled = blocks * inv
        magnitude = scaled.abs()
        floored = magnitude.floor()
        q = scaled.sign() * (floored + (2 * (magnitude - floored)).floor())  # half away from 0
        qs = q.to(torch.int8).view(torch.uint8)
    elif qtype == "Q4_0":
        at = blocks.abs().argmax(dim=1, keepdim=True)
        d = blocks.gather(1, at) / -8
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        nibbles = torch.trunc(blocks * inv + 8.5).clamp_(0, 15).to(torch.uint8)
        qs = nibbles[:, :16] | (nibbles[:, 16:] << 4)
    else:
        raise ValueError(f"no expert quantizer for {qtype!r} (Q8_0, Q4_0)")
    scale = d.to(torch.float16).view(torch.uint8)  # [blocks, 2]
    return torch.cat([scale, qs], dim=1).reshape(rows, -1)


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, method: str) -> QuantizedExperts:
    """One layer's ``w13 [E, 2L, H]`` and ``w2 [E, H, L]`` as ``method``'s blocks (gate,
    up and down stacks), an expert at a time (the float temporaries stay one expert big)."""
    qtype = EXPERT_TYPES[method]
    width = w13.shape[1] // 2
    gate = torch.stack([quantize_rows(w[:width], qtype) for w in w13])
    up = torch.stack([quantize_rows(w[width:], qtype) for w in w13])
    down = torch.stack([quantize_rows(w, qtype) for w in w2])
    return QuantizedExperts(gate, up, down, (qtype, qtype, qtype))


def why_float(hidden: int, width: int) -> str | None:
    """Why a layer's routed experts stay in the model dtype under ``--quantize int8|int4``
    (the op runs whole blocks; gpt-oss's biases and clamped SwiGLU are its optional
    arguments), or None.  ``width``: this shard's slice of the expert width."""
    if hidden % BLOCK or width % BLOCK:
        return f"hidden size {hidden} or this shard's expert width {width} not a multiple of 32"
    return None
