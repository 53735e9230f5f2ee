"""Arguments of ``genserve::decode_layer`` (kernels/decode_layer_cpu.cpp), the whole decoder
layer of a decode-only CPU step in one op, and which layer specs it implements."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from genserve.model.layers import _Packable
from genserve.model.spec import Activation, ModelConfig, NormKind, QKNorm


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the fused decode layer cannot run ``config``'s layers (None: it can).

    The op computes ``x += o(attn(rotary(qkv(rms_norm(x)))))``, then
    ``x += down(silu(gate) * up)(rms_norm(x))``: RMSNorm (``(1 + w)`` folded into the
    weight is the same op), rotary over whole heads (partial and interleaved rotary are
    permuted into that form, no-rope layers get identity angles), no q/k norm, no soft-cap."""
    block, attn, mlp = config.block, config.attention, config.mlp
    if config.moe is not None:
        return "mixture-of-experts MLP (its experts run as genserve::moe_experts)"
    if not block.is_llama:
        return "block is not sequential pre-norm"
    if config.norm.kind is NormKind.LAYER:
        return "LayerNorm"
    if attn.qk_norm is not QKNorm.NONE:
        return "q/k norm"
    if attn.softcap is not None:
        return "attention soft-capping"
    if not mlp.gated or mlp.activation is not Activation.SILU or mlp.bias:
        return "MLP is not SiLU-gated without bias"
    return None


@dataclass(frozen=True, slots=True)
class FusedDecodeArgs:
    """A layer's four projections (qkv, o, gate_up, down) as ``genserve::decode_layer``
    takes them: per projection (panels, quantized data or the plain weight; scales; mins),
    its bits (0: float32 panels, -1: a plain half-precision weight), group, output width and
    bias, an empty tensor standing for none; and the step size up to which plain weights go
    through the matvec (as ``layers._linear`` decides)."""

    weights: list[torch.Tensor]
    bits: list[int]
    groups: list[int]
    outs: list[int]
    biases: list[torch.Tensor | None]
    matvec_rows: int

    @classmethod
    def of(cls, linears: tuple[_Packable, ...]) -> FusedDecodeArgs | None:
        """None where a projection has none of those forms (a oneDNN-packed weight)."""
        args = cls([], [], [], [], [], linears[0].matvec_rows)
        empty = torch.empty(0)
        for linear in linears:
            if linear.matvec_rows != args.matvec_rows:
                return None
            if linear.panels is not None:
                args.weights.extend((linear.panels, empty, empty))
                args.bits.append(0)
                args.groups.append(0)
                args.outs.append(linear.panel_outputs)
            elif linear.qpanels is not None:
                q = linear.qpanels
                args.weights.extend((q.data, q.scales, empty if q.mins is None else q.mins))
                args.bits.append(q.fused_bits)
                args.groups.append(q.group)
                args.outs.append(q.out_features)
            elif linear.serves_plain_weight:
                args.weights.extend((linear.weight, empty, empty))
                args.bits.append(-1)
                args.groups.append(0)
                args.outs.append(linear.weight.shape[0])
            else:
                return None
            args.biases.append(getattr(linear, "bias", None))
        return args
