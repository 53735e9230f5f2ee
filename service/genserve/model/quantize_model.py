"""``--quantize``: replaces a loaded model's matrices by quantized ones (model/quantization.py).

* ``int8`` / ``int4``: quantize this rank's float weights after loading (so every checkpoint
  format and every tensor-parallel shard works the same way).  The layers' projections take
  the method; the embedding and the vocabulary projection (one shared matrix when tied) take
  int8 per-channel in both modes: it is the largest matrix of small models and the one whose
  errors reach every logit directly, which is why llama.cpp's own 4-bit presets keep their
  output matrix at 6-8 bits too.
* ``gguf``: keep the quantization of the GGUF file the model was converted from.  Matrices
  stored as Q8_0, Q4_0 or Q4_1 are served in that format, bit for bit (the float weights
  transformers dequantized from them are exactly what the reference computes with); matrices
  in other types (F32/F16, K-quants) stay in the model dtype, and the summary names them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog
import torch

from genserve.model.layers import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _Packable,
)
from genserve.model.llama import LlamaForCausalLM
from genserve.model.quantization import (
    QuantizationError,
    QuantizedWeight,
    cat_rows,
    quantize,
    quantize_int8,
)

log = structlog.get_logger("genserve.model")


@dataclass(slots=True)
class QuantizeSummary:
    method: str
    quantized: int = 0  # matrices now served quantized
    kept: list[str] = field(default_factory=list)  # names left in the model dtype (gguf)
    weight_bytes: int = 0  # bytes of every matrix this rank serves (quantized or not)


def quantize_model(
    model: LlamaForCausalLM,
    method: str,
    gguf_tensors: Mapping[str, QuantizedWeight] | None = None,
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
    seen: set[int] = set()  # a tied embedding and head share one matrix: count it once
    for module in _matrices(model):
        stored: QuantizedWeight | torch.Tensor = (
            module.quant if module.quant is not None else module.weight
        )
        if id(stored) not in seen:
            seen.add(id(stored))
            summary.weight_bytes += stored.nbytes
    log.info(
        "model_quantized",
        method=method,
        matrices=summary.quantized,
        kept_in_model_dtype=summary.kept[:8],
        kept_count=len(summary.kept),
        weight_mib=round(summary.weight_bytes / 2**20, 1),
    )
    return summary


def _matrices(model: LlamaForCausalLM) -> list[_Packable]:
    found: list[_Packable] = [model.embed_tokens, model.lm_head]
    for layer in model._layers:
        found.extend(model._linears(layer))
    return found


def _from_float(model: LlamaForCausalLM, method: str, summary: QuantizeSummary) -> None:
    for layer in model._layers:
        for linear in model._linears(layer):
            linear.set_quantized(quantize(linear.weight, method))
            summary.quantized += 1
    embed = quantize_int8(model.embed_tokens.weight)
    model.embed_tokens.set_quantized(embed)
    if model.config.tie_word_embeddings:
        model.lm_head.set_quantized(embed)
    else:
        model.lm_head.set_quantized(quantize_int8(model.lm_head.weight))
    summary.quantized += 2


def _from_gguf(
    model: LlamaForCausalLM, tensors: Mapping[str, QuantizedWeight], summary: QuantizeSummary
) -> None:
    def assign(module: _Packable, names: list[str], build: QuantizedWeight | None) -> None:
        if build is None:
            summary.kept.extend(names)
            return
        module.set_quantized(build)
        summary.quantized += 1

    def have(*names: str) -> bool:
        return all(n in tensors for n in names)

    for i, layer in enumerate(model._layers):
        prefix = f"model.layers.{i}"
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [f"{prefix}.self_attn.{p}_proj.weight" for p in "qkv"]
        assign(attn.qkv_proj, qkv, _qkv(attn.qkv_proj, *qkv, tensors) if have(*qkv) else None)
        o = f"{prefix}.self_attn.o_proj.weight"
        assign(attn.o_proj, [o], _row_parallel(attn.o_proj, tensors[o]) if have(o) else None)
        gate_up = [f"{prefix}.mlp.gate_proj.weight", f"{prefix}.mlp.up_proj.weight"]
        built = _column_parallel(mlp.gate_up_proj, gate_up, tensors) if have(*gate_up) else None
        assign(mlp.gate_up_proj, gate_up, built)
        down = f"{prefix}.mlp.down_proj.weight"
        assign(mlp.down_proj, [down], _row_parallel(mlp.down_proj, tensors[down]) if have(down) else None)  # fmt: skip
    embed_name = "model.embed_tokens.weight"
    embed = _vocab_rows(model.embed_tokens, tensors[embed_name]) if have(embed_name) else None
    assign(model.embed_tokens, [embed_name], embed)
    if model.config.tie_word_embeddings:
        if embed is not None:
            model.lm_head.set_quantized(embed)
    else:
        head = _vocab_rows(model.lm_head, tensors["lm_head.weight"]) if have("lm_head.weight") else None  # fmt: skip
        assign(model.lm_head, ["lm_head.weight"], head)


def _qkv(
    layer: QKVParallelLinear, q: str, k: str, v: str, tensors: Mapping[str, QuantizedWeight]
) -> QuantizedWeight:
    d = layer.head_dim
    kv_rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in layer.kv_heads])
    start, stop = layer.q_range
    return cat_rows(
        [tensors[q].rows(slice(start, stop)), tensors[k].rows(kv_rows), tensors[v].rows(kv_rows)]
    )


def _column_parallel(
    layer: ColumnParallelLinear, names: list[str], tensors: Mapping[str, QuantizedWeight]
) -> QuantizedWeight:
    return cat_rows(
        [tensors[n].rows(slice(a, b)) for n, (a, b) in zip(names, layer.ranges, strict=True)]
    )


def _row_parallel(layer: RowParallelLinear, weight: QuantizedWeight) -> QuantizedWeight:
    return weight.columns(*layer.in_range)


def _vocab_rows(layer: VocabParallelEmbedding, weight: QuantizedWeight) -> QuantizedWeight:
    """This rank's vocabulary rows, padded with zero rows to the rank's equal share."""
    rows = weight.rows(slice(layer.start, layer.stop))
    pad = layer.weight.shape[0] - rows.out_features
    if pad <= 0:
        return rows
    zero = QuantizedWeight(
        torch.zeros((pad, rows.data.shape[1]), dtype=rows.data.dtype),
        torch.zeros((pad, rows.scales.shape[1]), dtype=rows.scales.dtype),
        None if rows.mins is None else torch.zeros((pad, rows.mins.shape[1]), dtype=rows.mins.dtype),
        rows.bits, rows.group,
    )  # fmt: skip
    return cat_rows([rows, zero])
