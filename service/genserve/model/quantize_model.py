"""``--quantize``: replaces a loaded model's matrices by quantized ones (model/quantization.py).

* ``int8`` / ``int4``: quantize this rank's float weights after loading (so every checkpoint
  format and every tensor-parallel shard works the same way).  A mixture of experts' routed
  experts become GGUF Q8_0 / Q4_0 blocks for the CPU expert op (``model/moe_quant.py``).
  The layers' projections take the method; the embedding and the vocabulary projection (one
  shared matrix when tied) take int8 per-channel in both modes: it is the largest matrix of
  small models and the one whose errors reach every logit directly, which is why llama.cpp's
  own 4-bit presets keep their output matrix at 6-8 bits too.
* ``gguf``: keep the quantization of the GGUF file the model was converted from.  Matrices
  stored as Q8_0, Q4_0 or Q4_1 are served in that format, bit for bit (the float weights
  transformers dequantized from them are exactly what the reference computes with), K-quants
  (Q4_K, Q5_K, Q6_K) as their super-blocks (``model/kquants.py``; a fused projection may mix
  K types); matrices in other types (F32/F16, a fusion of K-quant and other blocks, a shard
  that splits a block) stay in the model dtype, and the summary names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog
import torch

from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.decoder import MLP, Attention
from genserve.model.kquants import AnyQuantized, cat_any, zero_rows
from genserve.model.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _Packable,
)
from genserve.model.moe import SparseMoeBlock
from genserve.model.moe_gguf import ExpertBlockSource, read_quantized_experts
from genserve.model.moe_quant import quantize_experts, why_float
from genserve.model.quantization import QuantizationError, quantize, quantize_int8

log = structlog.get_logger("genserve.model")


@dataclass(slots=True)
class QuantizeSummary:
    method: str
    quantized: int = 0  # matrices now served quantized
    kept: list[str] = field(default_factory=list)  # names left in the model dtype (gguf)
    weight_bytes: int = 0  # bytes of every weight this rank holds (model_weight_bytes)


def quantize_model(
    model: DecoderForCausalLM,
    method: str,
    gguf_tensors: Mapping[str, AnyQuantized] | None = None,
    gguf_experts: ExpertBlockSource | None = None,
) -> QuantizeSummary:
    """Quantize ``model`` in place (after ``load_weights``, before ``use_fused_cpu_ops``).
    With ``gguf``, ``gguf_experts`` (the file, ``GGUFWeights``) hands mixture-of-experts
    layers their routed experts as the file's blocks, before ``load_weights`` (which then
    skips them): no float copy of the experts is ever made."""
    summary = QuantizeSummary(method)
    with torch.inference_mode():
        if method == "gguf":
            if gguf_tensors is None:
                raise QuantizationError("--quantize gguf needs the model's GGUF file")
            _from_gguf(model, gguf_tensors, summary, gguf_experts)
        else:
            _from_float(model, method, summary)
    summary.weight_bytes = model_weight_bytes(model)
    log.info(
        "model_quantized",
        method=method,
        matrices=summary.quantized,
        kept_in_model_dtype=summary.kept[:8],
        kept_count=len(summary.kept),
        weight_mib=round(summary.weight_bytes / 2**20, 1),
    )
    return summary


def model_weight_bytes(model: DecoderForCausalLM) -> int:
    """Bytes of weights ``model`` holds: its parameters (a quantized or panel-packed layer's
    plain weight is empty) plus each quantized or packed matrix once (a tied embedding and
    head share one)."""
    total = sum(p.nbytes for p in model.parameters())
    seen: set[int] = set()
    for module in model.modules():
        for held in (getattr(module, "quant", None), getattr(module, "qpanels", None)):
            if held is not None and held.data.data_ptr() not in seen:
                seen.add(held.data.data_ptr())
                total += held.nbytes
        experts = getattr(module, "quantized_experts", None)
        if experts is not None:
            total += experts.nbytes
        for copy in (getattr(module, "panels", None), getattr(module, "float_weight", None)):
            if copy is not None and copy.data_ptr() not in seen:
                seen.add(copy.data_ptr())
                total += copy.nbytes
    return int(total)


def _from_float(model: DecoderForCausalLM, method: str, summary: QuantizeSummary) -> None:
    for i, layer in enumerate(model._layers):
        for linear in model._linears(layer):
            linear.set_quantized(quantize(linear.weight, method))
            summary.quantized += 1
        if isinstance(layer.mlp, SparseMoeBlock):
            _quantize_routed_experts(layer.mlp, method, f"model.layers.{i}", summary)
        if not isinstance(layer.self_attn, Attention):  # decodes read it per head (mla.py)
            summary.kept.append(f"model.layers.{i} kv_b_proj")
    embed = quantize_int8(model.embed_tokens.weight)
    model.embed_tokens.set_quantized(embed)
    if model.config.tie_word_embeddings:
        model.lm_head.set_quantized(embed)
    else:
        model.lm_head.set_quantized(quantize_int8(model.lm_head.weight))
    summary.quantized += 2


def _quantize_routed_experts(
    moe: SparseMoeBlock, method: str, prefix: str, summary: QuantizeSummary
) -> None:
    """A MoE layer's routed experts as Q8_0 / Q4_0 blocks (``model/moe_quant.py``) for the
    CPU expert op; those the op cannot run stay in the model dtype, named with the reason."""
    if moe.quantized_experts is not None:  # already blocks (gpt-oss's released MXFP4)
        summary.quantized += 3
        return
    width, hidden = moe.w2.shape[2], moe.w2.shape[1]
    # Under expert parallelism w13/w2 hold this shard's experts only: those are quantized.
    reason = why_float(hidden, width)
    if reason is None and moe.w13.device.type != "cpu":
        reason = "the quantized expert op is CPU-only (CUDA runs float experts in Triton)"
    if reason is not None:
        log.info("model_quantized_kept_float", matrices=[f"{prefix} experts"], reason=reason)
        summary.kept.append(f"{prefix} experts")
        return
    moe.set_quantized_experts(quantize_experts(moe.w13, moe.w2, method))
    summary.quantized += 3


def _from_gguf(
    model: DecoderForCausalLM,
    tensors: Mapping[str, AnyQuantized],
    summary: QuantizeSummary,
    experts: ExpertBlockSource | None = None,
) -> None:
    plan: list[tuple[_Packable, list[str]]] = []
    for i, layer in enumerate(model._layers):
        attn = f"model.layers.{i}.self_attn"
        mlp = f"model.layers.{i}.mlp"
        if not isinstance(layer.self_attn, Attention):  # serving_path sends these elsewhere
            raise QuantizationError("latent attention has no GGUF tensor mapping")
        plan += [
            (layer.self_attn.qkv_proj, [f"{attn}.{p}_proj.weight" for p in "qkv"]),
            (layer.self_attn.o_proj, [f"{attn}.o_proj.weight"]),
        ]
        if isinstance(layer.mlp, SparseMoeBlock):
            plan += _moe_plan(layer.mlp, f"model.layers.{i}", summary, experts)
            continue
        if not isinstance(layer.mlp, MLP):  # another MLP kind: stays in the model dtype
            summary.kept.append(f"model.layers.{i} mlp")
            continue
        plan += [
            (layer.mlp.gate_up_proj, [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"]),
            (layer.mlp.down_proj, [f"{mlp}.down_proj.weight"]),
        ]
    plan.append((model.embed_tokens, ["model.embed_tokens.weight"]))
    if not model.config.tie_word_embeddings:
        plan.append((model.lm_head, ["lm_head.weight"]))
    for module, names in plan:
        if not all(n in tensors for n in names):  # a type without a kernel: stays float
            summary.kept.extend(names)
            continue
        try:
            shard = _shard(module, [tensors[n] for n in names])
        except QuantizationError as exc:  # no layout for it: served from the floats
            log.info("model_quantized_kept_float", matrices=names, reason=str(exc))
            summary.kept.extend(names)
            continue
        module.set_quantized(shard)
        summary.quantized += 1
    embed = model.embed_tokens.quant
    if model.config.tie_word_embeddings and embed is not None:
        model.lm_head.set_quantized(embed)


def _moe_plan(
    moe: SparseMoeBlock, prefix: str, summary: QuantizeSummary, experts: ExpertBlockSource | None
) -> list[tuple[_Packable, list[str]]]:
    """A MoE layer's routed experts set from the file's blocks (where the op runs their
    types), and its shared expert's matrices planned as a dense MLP's."""
    names = moe.spec.names
    stacked = None
    if experts is not None and not moe.ctx.expert_parallel:
        stacked = read_quantized_experts(
            experts, f"{prefix}.{names.experts}", moe.width_range, moe.spec.intermediate_size
        )
    if stacked is None:
        summary.kept.append(f"{prefix} experts")
    else:
        moe.set_quantized_experts(stacked)
        summary.quantized += 3
    shared = moe.shared
    if not isinstance(shared, MLP):
        return []
    at = f"{prefix}.{names.shared}"
    return [
        (shared.gate_up_proj, [f"{at}.gate_proj.weight", f"{at}.up_proj.weight"]),
        (shared.down_proj, [f"{at}.down_proj.weight"]),
    ]


def _shard(module: _Packable, parts: list[AnyQuantized]) -> AnyQuantized:
    """This rank's part of the file's matrices, fused as ``module`` stores them."""
    if isinstance(module, QKVParallelLinear):
        return _qkv(module, *parts)
    if isinstance(module, ColumnParallelLinear):  # gate/up
        ranges = zip(parts, module.ranges, strict=True)
        return cat_any([part.rows(slice(a, b)) for part, (a, b) in ranges])
    if isinstance(module, RowParallelLinear):
        return parts[0].columns(*module.in_range)
    assert isinstance(module, VocabParallelEmbedding)
    return _vocab_rows(module, parts[0])


def _qkv(
    layer: QKVParallelLinear, q: AnyQuantized, k: AnyQuantized, v: AnyQuantized
) -> AnyQuantized:
    d = layer.head_dim
    kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in layer.kv_heads])
    start, stop = layer.q_range
    return cat_any([q.rows(slice(start, stop)), k.rows(kv_rows), v.rows(kv_rows)])


def _vocab_rows(layer: VocabParallelEmbedding, weight: AnyQuantized) -> AnyQuantized:
    """This rank's vocabulary rows, padded with zero rows to the rank's equal share."""
    rows = weight.rows(slice(layer.start, layer.stop))
    pad = layer.weight.shape[0] - rows.out_features
    if pad <= 0:
        return rows
    return cat_any([rows, zero_rows(rows, pad)])
