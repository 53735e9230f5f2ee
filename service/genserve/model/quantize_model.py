"""``--quantize``: replaces a loaded model's matrices by quantized ones (model/quantization.py).

* ``int8`` / ``int4``: quantize this rank's float weights after loading (so every checkpoint
  format and every tensor-parallel shard works the same way).  The layers' projections take
  the method; the embedding and the vocabulary projection (one shared matrix when tied) take
  int8 per-channel in both modes: it is the largest matrix of small models and the one whose
  errors reach every logit directly, which is why llama.cpp's own 4-bit presets keep their
  output matrix at 6-8 bits too.
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
) -> QuantizeSummary:
    """Quantize ``model`` in place (after ``load_weights``, before ``use_fused_cpu_ops``)."""
    summary = QuantizeSummary(method)
    with torch.inference_mode():
        if method == "gguf":
            if gguf_tensors is None:
                raise QuantizationError("--quantize gguf needs the model's GGUF file")
            _from_gguf(model, gguf_tensors, summary)
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
        if not isinstance(layer.mlp, MLP):  # routed experts: no quantized expert op yet
            summary.kept.append(f"model.layers.{i} experts")
        if not isinstance(layer.self_attn, Attention):  # decodes read it per head (mla.py)
            summary.kept.append(f"model.layers.{i} kv_b_proj")
    embed = quantize_int8(model.embed_tokens.weight)
    model.embed_tokens.set_quantized(embed)
    if model.config.tie_word_embeddings:
        model.lm_head.set_quantized(embed)
    else:
        model.lm_head.set_quantized(quantize_int8(model.lm_head.weight))
    summary.quantized += 2


def _from_gguf(
    model: DecoderForCausalLM, tensors: Mapping[str, AnyQuantized], summary: QuantizeSummary
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
        if not isinstance(layer.mlp, MLP):  # a mixture of experts: stays in the model dtype
            summary.kept.append(f"model.layers.{i} experts")
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
