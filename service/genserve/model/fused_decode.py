"""Arguments of ``genserve::decode_layer`` (kernels/decode_layer_cpu.cpp), the whole decoder
layer of a decode-only CPU step in one op, and which layer specs it implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from genserve.model.kquants import K_TYPES, KQuantWeight
from genserve.model.layers import _Packable
from genserve.model.spec import Activation, ModelConfig, NormKind, QKNorm

# The op's option codes (decode_layer_cpu.cpp's Option enum documents each).
_NORM_KINDS = {NormKind.RMS: 0, NormKind.RMS_ONE_PLUS: 0, NormKind.LAYER: 1}
_QK_NORMS = {QKNorm.NONE: 0, QKNorm.PER_HEAD: 1, QKNorm.FULL_WIDTH: 2}
_RMS = (NormKind.RMS, NormKind.RMS_ONE_PLUS)
_ACTIVATIONS = {Activation.SILU: 0, Activation.GELU: 1, Activation.GELU_TANH: 2}
# A projection's ``bits`` for GGUF K-quant rows (decode_layer_cpu.cpp's kKQuantBits).
_KQUANT_BITS = 200


def unsupported_reason(config: ModelConfig) -> str | None:
    """Why the fused decode layer cannot run ``config``'s layers (None: it can).

    The op implements every part a native spec names today (see decode_layer_cpu.cpp): RMS
    or LayerNorm (``(1 + w)`` folded into the weight is RMSNorm), any subset of the four
    block norms, per-head or full-width q/k norm, soft-capping, scales and multipliers,
    parallel blocks, SiLU/GELU MLPs gated or not, biases.  Rotary over whole heads serves
    partial and interleaved rotary too (permuted into that form at load; no-rope layers get
    identity angles).  A mixture-of-experts layer runs its attention half as one op
    (``genserve::decode_attention``, Llama blocks only) and its experts after it; the
    model's dense layers run whole.  A part added to the spec later lands here as a reason
    until the op learns it, and the model keeps its per-op path."""
    attn, mlp, block = config.attention, config.mlp, config.block
    if config.mla is not None:
        return "multi-head latent attention (model/mla.py)"
    if config.moe is not None and not (config.block.is_llama and config.norm.kind in _RMS):
        # Its MoE layers run the attention half as genserve::decode_attention, which ends
        # in the Llama block's add + RMSNorm (the experts run as genserve::moe_experts).
        return "mixture-of-experts MLP in a block other than Llama's"
    if attn.sinks:  # the op's attention call passes none (so far only MoE models have them)
        return "attention sinks"
    if config.norm.kind not in _NORM_KINDS or attn.qk_norm_spec.kind not in _NORM_KINDS:
        return f"norm kind {config.norm.kind} / {attn.qk_norm_spec.kind}"
    if attn.qk_norm not in _QK_NORMS:
        return f"q/k norm {attn.qk_norm}"
    if (
        attn.qk_norm is not QKNorm.NONE
        and attn.qk_norm_weights_per_head
        and attn.qk_norm_spec.kind is not NormKind.LAYER
    ):
        return "per-head q/k RMSNorm weights"  # genserve's rms_norm takes one weight row
    if mlp.activation not in _ACTIVATIONS:
        return f"activation {mlp.activation}"
    if block.parallel and (block.post_attn_norm or block.post_mlp_norm):
        return "post-sublayer norms in a parallel block"
    if block.parallel and block.residual_multiplier != 1.0:
        return "residual multiplier in a parallel block"
    return None


def layer_options(config: ModelConfig, scale: float) -> tuple[list[int], list[float]]:
    """The op's ``options`` and ``scalars`` for ``config``'s layers (one softmax ``scale``
    for all: the spec's); ``unsupported_reason(config)`` must be None."""
    attn, mlp, block = config.attention, config.mlp, config.block
    options = [
        _NORM_KINDS[config.norm.kind],
        _QK_NORMS[attn.qk_norm],
        _NORM_KINDS[attn.qk_norm_spec.kind],
        _ACTIVATIONS[mlp.activation],
        int(mlp.gated),
        int(block.parallel),
    ]
    softcap = 0.0 if attn.softcap is None else attn.softcap
    scalars = [config.norm.eps, attn.qk_norm_spec.eps, scale, softcap, block.residual_multiplier]
    return options, scalars


@dataclass(frozen=True, slots=True)
class FusedDecodeArgs:
    """A layer's four projections (qkv, o, gate_up, down) as ``genserve::decode_layer``
    takes them: per projection (panels, quantized data or the plain weight; scales; mins),
    its bits (0: float32 panels, -1: a plain half-precision weight), group, output width and
    bias, an empty tensor standing for none; and the step size up to which plain weights go
    through the matvec (as ``layers._linear`` decides).  GGUF K-quant rows go as (their
    super-blocks; their segments' GGML type codes; row counts), bits 200 and the kernel path
    (``KQuantWeight.isa``: float or an integer one) in place of the group."""

    weights: list[torch.Tensor]
    bits: list[int]
    groups: list[int]
    outs: list[int]
    biases: list[torch.Tensor | None]
    matvec_rows: int

    @classmethod
    def of(cls, linears: tuple[_Packable, ...]) -> FusedDecodeArgs | None:
        """None where a projection has none of those forms (a oneDNN-packed weight: those
        layers step through the layer-by-layer path)."""
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
            elif isinstance(linear.qpanels, KQuantWeight):
                k = linear.qpanels
                codes = torch.tensor([K_TYPES[t][0] for t in k.types], dtype=torch.int64)
                rows = torch.tensor(k.row_counts, dtype=torch.int64)
                args.weights.extend((k.data, codes, rows))
                args.bits.append(_KQUANT_BITS)
                args.groups.append(k.isa)  # the kernel path, as KQuantWeight.linear passes it
                args.outs.append(k.out_features)
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


def decode_stack(
    layer_args: Sequence[tuple[object, ...] | None], tables: Sequence[int]
) -> torch.ScriptObject | None:
    """A ``genserve::DecodeStack`` of every layer (its ``decode_layer`` arguments but the
    step's tensors, from ``DecoderLayer.fused_decode_call``; layer i rotating by table
    ``tables[i]``), which ``genserve::decode_layers`` runs in one call; None where some layer
    is not a whole-layer op (a mixture of experts: those step layer by layer).  Built once:
    the op keeps the layers' tensors, so a model whose weights or layout change afterwards
    must build it again."""
    if any(args is None for args in layer_args):
        return None
    stack = torch.classes.genserve.DecodeStack()
    for args, table in zip(layer_args, tables, strict=True):
        assert args is not None
        stack.add_layer(*args, table)
    built: torch.ScriptObject = stack
    return built
