"""Routed experts kept in a GGUF file's quantized blocks (``--quantize gguf``, the default
for a ``.gguf`` model on CPU): what a mixture-of-experts layer holds instead of float
``w13``/``w2`` when its ``ffn_{gate,up,down}_exps`` are Q8_0, Q4_0, MXFP4 (gpt-oss), Q4_K,
Q5_K or Q6_K.  gpt-oss's expert biases and clamped SwiGLU are the op's optional arguments
(the layer's ``b13``/``b2`` stay float beside the blocks).

Each projection is the file's stack ``[E, rows, row bytes]`` (uint8, bytes as stored, read
by ``GGUFWeights.expert_blocks``), so a Q4_K_M model's experts take the file's 4.5-6.6 bits
per weight in memory, never a float copy.  On CPU with genserve's kernels the layer's routed
part is one op, ``genserve::moe_experts_gguf`` (``kernels/moe_quant_cpu.cpp``): rows grouped
by expert, only the chosen experts' blocks read, on the float path (blocks dequantized as
gguf-py does) or, with ``--cpu-int-dot``, on int8 activations as llama.cpp multiplies them.
Elsewhere (CUDA, ``--disable-cpu-kernels``) :func:`experts_gguf_torch` dequantizes the chosen
experts with gguf-py's own dequantizer and runs the torch loop: the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from genserve.model.kquants import FLOAT_PATH
from genserve.model.spec import ClampedSwiGLU

if TYPE_CHECKING:
    from genserve.model.huge_pages import HugePageRegion

# Q8_0 expert rows interleaved in groups of 16 for the AVX512-VNNI path (one 512-bit
# VPDPBUSD per 4 inputs of 16 rows): the same bytes rearranged by
# ``genserve::moe_pack_q8_0_r16``, never in a file.
PACKED_Q8_0 = "Q8_0_R16"
PACK_ROWS = 16

# GGML type codes (gguf's GGMLQuantizationType) of the expert types the op runs, and
# genserve's own code for Q8_0 rows repacked in groups of 16 (kernels/moe_q8_r16_row.inc).
GGML_CODES = {
    "Q4_0": 2,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "MXFP4": 39,
    PACKED_Q8_0: 1008,
}


class ExpertBlockSource(Protocol):
    """Where stacked experts come from in their stored blocks (``GGUFWeights``)."""

    def expert_blocks(self, name: str) -> tuple[torch.Tensor, str] | None: ...


@dataclass(frozen=True, slots=True)
class QuantizedExperts:
    """One layer's routed experts as GGUF blocks: ``gate``/``up`` uint8 ``[E, L, bytes]``,
    ``down`` ``[E, H, bytes]``, each with its GGML type name; ``isa`` the kernel path
    (``kquants.FLOAT_PATH`` or an ``int_dot.Isa``)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    types: tuple[str, str, str]
    isa: int = FLOAT_PATH

    @property
    def nbytes(self) -> int:
        return int(self.gate.nbytes + self.up.nbytes + self.down.nbytes)

    @property
    def codes(self) -> list[int]:
        return [GGML_CODES[t] for t in self.types]

    def serving(self, isa: int) -> QuantizedExperts:
        """The same blocks on kernel path ``isa``: Q8_0 projections packed in groups of 16
        rows where that path is AVX512-VNNI (``isa`` naming it, or AUTO on a CPU that has
        it), unpacked back to the file's layout on any other path; one copy of the bytes
        either way (the unpacked blocks are dropped, a file's pages stay in the page cache
        only)."""
        pack = _packs(isa)
        projections = zip((self.gate, self.up, self.down), self.types, strict=True)
        (gate, tg), (up, tu), (down, td) = (_layout(b, t, pack) for b, t in projections)
        return replace(self, gate=gate, up=up, down=down, types=(tg, tu, td), isa=isa)

    def placed(self, region: HugePageRegion) -> QuantizedExperts:
        """The same blocks copied into ``region`` (2 MiB pages, ``model/huge_pages.py``):
        a step reads 8-50 experts' rows, ~1.7 MB a projection each at Qwen3-30B-A3B's shape,
        and in 4 KiB pages each of those streams stops the prefetchers at every page.
        A projection the region has no room for stays where it is."""
        return replace(
            self,
            gate=region.place(self.gate),
            up=region.place(self.up),
            down=region.place(self.down),
        )

    def forward(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        clamped: ClampedSwiGLU | None = None,
    ) -> torch.Tensor:
        """The routed sum through ``genserve::moe_experts_gguf`` (CPU kernels loaded), with
        gpt-oss's biases ``b13 [E, 2L]``, ``b2 [E, H]`` and clamped SwiGLU where given."""
        out: torch.Tensor = torch.ops.genserve.moe_experts_gguf(
            x, ids, weights, self.gate, self.up, self.down, self.codes, self.isa, b13, b2,
            0.0 if clamped is None else clamped.alpha,
            0.0 if clamped is None else clamped.limit,
        )  # fmt: skip
        return out


def _packs(isa: int) -> bool:
    """Whether kernel path ``isa`` runs Q8_0 experts packed in groups of 16 rows."""
    from genserve.kernels import int_dot

    if isa not in (int_dot.Isa.AUTO, int_dot.Isa.AVX512_VNNI):
        return False
    return int_dot.Isa.AVX512_VNNI in int_dot.available_isas()


def _layout(blocks: torch.Tensor, qtype: str, pack: bool) -> tuple[torch.Tensor, str]:
    """One projection's blocks in the layout ``pack`` asks for (only Q8_0 with whole groups
    of 16 rows is ever packed)."""
    if pack and qtype == "Q8_0" and blocks.shape[1] % PACK_ROWS == 0:
        packed: torch.Tensor = torch.ops.genserve.moe_pack_q8_0_r16(blocks.contiguous())
        return packed, PACKED_Q8_0
    if not pack and qtype == PACKED_Q8_0:
        plain: torch.Tensor = torch.ops.genserve.moe_pack_q8_0_r16(blocks, True)
        return plain, "Q8_0"
    return blocks, qtype


def read_quantized_experts(
    source: ExpertBlockSource, experts_prefix: str, width: tuple[int, int], full: int
) -> QuantizedExperts | None:
    """``{experts_prefix}.{gate,up,down}_proj`` from ``source`` as blocks, or None when any
    of the three is not in a type the op runs, or this shard's slice ``width`` of the expert
    width ``full`` is not the whole (a tensor-parallel shard would cut the down projection's
    blocks: those layers are served in floats)."""
    if width != (0, full):
        return None
    parts = [source.expert_blocks(f"{experts_prefix}.{p}_proj") for p in ("gate", "up", "down")]
    if any(p is None for p in parts):
        return None
    (gate, tg), (up, tu), (down, td) = (p for p in parts if p is not None)
    return QuantizedExperts(gate, up, down, (tg, tu, td))


def dequantize_expert(blocks: torch.Tensor, qtype: str, expert: int) -> torch.Tensor:
    """Expert ``expert``'s matrix ``[rows, cols]`` in float32, by gguf-py's dequantizer."""
    from gguf import GGMLQuantizationType, dequantize

    raw = blocks[expert].numpy()
    values = dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def experts_gguf_torch(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: QuantizedExperts,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    clamped: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The routed experts in torch on the dequantized blocks of the chosen experts (the
    portable path and the kernel's reference): ``model.moe.experts_torch``'s loop, biases
    and clamped SwiGLU included where given."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    xf = x.float()
    tg, tu, td = experts.types
    width = experts.gate.shape[1]
    for expert in torch.unique(ids).tolist():
        token_idx, k_pos = torch.where(ids == expert)
        rows = xf[token_idx]
        gate = rows @ dequantize_expert(experts.gate, tg, expert).t()
        up = rows @ dequantize_expert(experts.up, tu, expert).t()
        if b13 is not None:
            gate = gate + b13[expert, :width].float()
            up = up + b13[expert, width:].float()
        if clamped is None:
            act = torch.nn.functional.silu(gate) * up
        else:
            gate = gate.clamp(max=clamped.limit)
            up = up.clamp(-clamped.limit, clamped.limit)
            act = (up + 1) * gate * torch.sigmoid(gate * clamped.alpha)
        y = act @ dequantize_expert(experts.down, td, expert).t()
        if b2 is not None:
            y = y + b2[expert].float()
        out.index_add_(0, token_idx, y * weights[token_idx, k_pos, None].float())
    return out.to(x.dtype)
