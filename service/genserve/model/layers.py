"""Linear and embedding parts of the native decoder, for a flat token batch and tensor
parallelism.

Every activation is ``[num_tokens, features]``: the sequences of a step are concatenated, never
padded.  Linear layers follow the Megatron split:

- :class:`ColumnParallelLinear` (and its fused forms :class:`MergedColumnParallelLinear`,
  :class:`QKVParallelLinear`) keep a slice of the *output* features; no communication.
- :class:`RowParallelLinear` keeps a slice of the *input* features and all-reduces its output.
- :class:`VocabParallelEmbedding` / :class:`ParallelLMHead` split the vocabulary.

Each layer loads its own shard from a :class:`~genserve.model.weights.WeightSource`, reading
only its rows or columns.  At world size 1 the shards are the whole tensors and the
collectives are no-ops.

A little over ~500 lines: it holds the norm, the rotary embedding and the parallel linear
layers; moving them into separate parts is the "models as parts" work (DESIGN.md, wave 3),
left to it so that the module is not rewritten twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from genserve.kernels import int_dot, prefill_gemm
from genserve.model.embedding_rows import DequantizedRowCache
from genserve.model.huge_pages import HugePageRegion
from genserve.model.int_dot_panels import IntDotPanels
from genserve.model.kquants import FLOAT_PATH, AnyQuantized, KQuantWeight
from genserve.model.lora import LoraHook
from genserve.model.spec import UnsupportedModelError
from genserve.model.weight_panels import (
    QuantizedPanels,
    float_panel_rows,
    half_panels_enabled,
    pack_float,
    pack_half_exact,
)
from genserve.model.weights import WeightSource
from genserve.parallel import ParallelContext

if TYPE_CHECKING:
    from genserve.model.gpu_gemv_plan import GemvChoice


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def _copy_in(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.copy_(loaded)


# oneDNN chooses its blocked weight layout for this many rows per matmul; any row count works.
_PACK_BATCH_HINT = 32


def _pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout, or None where that does not apply.

    On CPU in bfloat16 the prepacked matmul gives the same results as ``F.linear`` and is
    ~25% faster at 4-64 rows per step (measured on the default model's shapes; equal at one
    row).  float32 keeps ``F.linear`` (MKL), whose results transformers' reference shares."""
    if (
        weight.device.type != "cpu"
        or weight.dtype != torch.bfloat16
        or not torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
    ):
        return None
    try:
        packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), _PACK_BATCH_HINT
        )
        return packed
    except (RuntimeError, AttributeError):  # an older or differently built torch
        return None


def _linear(layer: _Packable, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x Wᵀ + b`` by the fastest path ``layer`` has: genserve's column-panel kernel
    (quantized or float32 weights), the quantized torch reference, the Triton few-row matmul
    (CUDA), the weight-streaming matvec for few rows (half precision, CPU), oneDNN's packed
    weight, or ``F.linear``."""
    if layer.qpanels is not None:  # quantized, in column panels (kernels/panel_gemm_cpu)
        return layer.qpanels.linear(x, bias)
    if layer.quant is not None:  # no kernel here (CUDA, --disable-cpu-kernels): reference
        return F.linear(x, layer.quant.dequantize(x.dtype), bias)
    if layer.panels is not None:  # float32 in column panels (kernels/panel_gemm_cpu), any M
        panel_out: torch.Tensor = torch.ops.genserve.panel_linear(
            x, layer.panels, layer.panel_outputs, bias
        )
        return panel_out
    weight = layer.weight
    if layer.gpu_gemv and (tile := layer.gpu_gemv.tile_for(x.shape[0])):  # CUDA, 1-4 rows
        return layer.gpu_gemv.run(x, weight, bias, tile)
    if x.shape[0] <= layer.matvec_rows and weight.numel():  # stream W (kernels/matvec_cpu)
        small: torch.Tensor = torch.ops.genserve.matvec(x, weight, bias)
        return small
    if layer.packed is not None:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, layer.packed, bias, "none", [], ""
        )
        return out
    return F.linear(x, weight, bias)


class _Packable(nn.Module):
    """A layer whose ``weight`` may be replaced by a prepacked copy once loaded, or by a
    quantized one (``--quantize``)."""

    weight: torch.Tensor
    packed: torch.Tensor | None = None
    # Steps of at most this many rows use genserve's weight-streaming CPU matvec (set by
    # DecoderForCausalLM.use_fused_cpu_ops; 0: never).
    matvec_rows: int = 0
    # CUDA: the Triton few-row matmul's tile per row count, where it beat cuBLAS when timed
    # on this GPU at load (model/gpu_gemv_plan.py; None: cuBLAS at every row count).
    gpu_gemv: GemvChoice | None = None
    # --quantize: the weight in a quantized format (model/quantization.py), used instead of
    # ``weight`` (moved to ``qpanels`` where genserve's CPU kernels run).
    quant: AnyQuantized | None = None
    # float32 on CPU with genserve's kernels: the weight as 32-column panels
    # (``weight_panels.pack_float``), which every step uses instead of ``weight``.
    panels: torch.Tensor | None = None
    panel_outputs: int = 0  # the weight's rows (the last panel is zero-padded)
    # A quantized weight in the same panels (replaces ``quant``; same kernel file), or, with
    # --cpu-int-dot, in the integer dot-product kernel's panels (kernels/int_dot_cpu.cpp); a
    # GGUF K-quant matrix as its own super-blocks (kernels/kquant_cpu.cpp, either path).
    qpanels: QuantizedPanels | IntDotPanels | KQuantWeight | None = None

    def pack(self, release: bool = True) -> None:
        """Switch to the prepacked weight (if it applies); ``release`` frees the plain copy
        (not done when the weight is shared, e.g. tied embeddings).  Call after loading."""
        if self.quant is not None:
            return
        self.packed = _pack_weight(self.weight)
        if self.packed is not None and release:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def use_panels(self, release: bool = True) -> None:
        """Serve from the weight packed in column panels (float32 or quantized CPU weights,
        with genserve's kernels loaded); ``release`` frees the plain copy.  Call after
        loading (and quantizing)."""
        if isinstance(self.quant, KQuantWeight):  # the kernel reads the file's blocks as they are
            choice = int_dot.choose() if int_dot.active() else None
            isa = FLOAT_PATH if choice is None or choice.isa is None else int(choice.isa)
            many_rows = prefill_gemm.bf16_min_rows() if isa != FLOAT_PATH else 0
            tiled_rows = prefill_gemm.int_gemm_min_rows() if isa != FLOAT_PATH else 0
            self.qpanels = self.quant.serving(isa, many_rows, tiled_rows)
            if release:
                self.quant = None
            return
        if self.quant is not None:
            if IntDotPanels.supports(self.quant) and int_dot.active():
                self.qpanels = dataclasses.replace(
                    IntDotPanels.pack(self.quant), bf16_rows=prefill_gemm.bf16_min_rows(blocks=True)
                )
                if release:
                    self.quant = None
            elif QuantizedPanels.supports(self.quant):
                self.qpanels = QuantizedPanels.pack(self.quant)
                if release:
                    self.quant = None
            return
        if self.weight.dtype != torch.float32 or not self.weight.numel():
            return
        weight = self.weight.detach()
        # float16 values (an F16 file served in float32): the same sums from half the bytes
        half = pack_half_exact(weight) if half_panels_enabled() else None
        self.panels = pack_float(weight) if half is None else half
        self.panel_outputs = self.weight.shape[0]
        if release:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    @property
    def serves_plain_weight(self) -> bool:
        """Whether steps read ``weight`` itself: no panels, quantized or prepacked copy
        replaces it, and it is not the emptied placeholder one of those leaves."""
        return (
            self.panels is None
            and self.qpanels is None
            and self.quant is None
            and self.packed is None
            and bool(self.weight.numel())
        )

    def streamed_weights(self) -> list[torch.Tensor]:
        """The tensors a CPU decode step reads from this layer: its panels, its quantized
        panels, or its plain weight (half precision); none for a prepacked or quantized one
        the kernels do not read."""
        if self.panels is not None:
            return [self.panels]
        if isinstance(self.qpanels, KQuantWeight):
            return [self.qpanels.data]
        if self.qpanels is not None:
            q = self.qpanels
            return [q.data, q.scales] + ([] if q.mins is None else [q.mins])
        return [self.weight.detach()] if self.serves_plain_weight else []

    def move_streamed_weights(self, region: HugePageRegion) -> None:
        """Replace the tensors of :meth:`streamed_weights` by copies placed in ``region``."""
        if self.panels is not None:
            self.panels = region.place(self.panels)
        elif isinstance(self.qpanels, KQuantWeight):
            self.qpanels = dataclasses.replace(self.qpanels, data=region.place(self.qpanels.data))
        elif self.qpanels is not None:
            q = self.qpanels
            self.qpanels = dataclasses.replace(
                q,
                data=region.place(q.data),
                scales=region.place(q.scales),
                mins=None if q.mins is None else region.place(q.mins),
            )
        elif self.serves_plain_weight:
            self.weight = nn.Parameter(region.place(self.weight.detach()), requires_grad=False)

    def set_quantized(self, quant: AnyQuantized) -> None:
        """Serve from ``quant`` (same shape as ``weight``) and free the plain weight; a tied
        embedding and head share one ``quant``."""
        if (quant.out_features, quant.in_features) != tuple(self.weight.shape):
            raise ValueError(
                f"quantized weight {(quant.out_features, quant.in_features)} does not match "
                f"{tuple(self.weight.shape)}"
            )
        self.quant = quant.to(self.weight.device)
        self.packed = None
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)


class ColumnParallelLinear(_Packable):
    """``y = x Wᵀ + b`` keeping rows ``[start, stop)`` of ``W`` (output features) per rank.

    ``out_sizes`` lists the logical matrices fused into this one (e.g. gate and up); each is
    split separately so that a rank's output is ``[its gate slice | its up slice]``.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: Sequence[int],
        bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.ranges = [ctx.shard(size, "output features") for size in out_sizes]
        local = sum(stop - start for start, stop in self.ranges)
        self.weight = _empty(local, in_features, dtype=dtype, device=device)
        self.bias = _empty(local, dtype=dtype, device=device) if bias else None

    lora: LoraHook | None = None  # multi-LoRA deltas (genserve.model.lora), when enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _linear(self, x, self.bias)  # [tokens, out]
        return y if self.lora is None else self.lora.add_delta(x, y)

    def load(self, weights: WeightSource, prefixes: Sequence[str]) -> None:
        """``prefixes[i]`` names the ``i``-th fused matrix (``…gate_proj``, ``…up_proj``)."""
        self._load_rows(weights, [(p, [r]) for p, r in zip(prefixes, self.ranges, strict=True)])

    def _load_rows(
        self, weights: WeightSource, parts: Sequence[tuple[str, Sequence[tuple[int, int]]]]
    ) -> None:
        for suffix, param in (("weight", self.weight), ("bias", self.bias)):
            # A weight already given in a quantized format (GGUF blocks) is not read again.
            if param is None or (suffix == "weight" and self.quant is not None):
                continue
            pieces = [
                weights.get_slice(f"{prefix}.{suffix}", 0, start, stop)
                for prefix, ranges in parts
                for start, stop in ranges
            ]
            _copy_in(param, torch.cat(pieces, dim=0), f"{parts[0][0]}.{suffix}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Fused gate/up projection: one matmul instead of two (less per-layer overhead)."""


def local_kv_heads(num_heads: int, num_kv_heads: int, ctx: ParallelContext) -> tuple[int, ...]:
    """Global indices of the KV heads this rank stores, in local order.

    The rank owns query heads ``ctx.balanced_shard(num_heads)`` (equal shares when they
    divide, else one more on the first ranks); query head ``q`` reads KV head
    ``q // (num_heads // num_kv_heads)``.  When the needed KV heads serve the local query
    heads in equal consecutive groups they are stored once each (the usual case, including
    replication when there are fewer KV heads than ranks); otherwise one KV head is stored per
    local query head, so that local grouping is always uniform.
    """
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"{num_heads} query heads vs {num_kv_heads} KV heads")
    start, stop = ctx.balanced_shard(num_heads)
    if start == stop:
        raise UnsupportedModelError(
            f"{num_heads} query heads cannot be split across {ctx.world_size} shards "
            f"(use at most {num_heads})"
        )
    per_rank = stop - start
    group = num_heads // num_kv_heads
    needed = list(range(start // group, (stop - 1) // group + 1))
    if per_rank % len(needed) == 0:
        local_group = per_rank // len(needed)
        if all((start + j) // group == needed[j // local_group] for j in range(per_rank)):
            return tuple(needed)
    return tuple((start + j) // group for j in range(per_rank))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused Q/K/V projection; output ``[num_tokens, (local_heads + 2*local_kv_heads) *
    head_dim]`` laid out as ``[q | k | v]``."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        nn.Module.__init__(self)
        self.ctx = ctx
        self.head_dim = head_dim
        q_start, q_stop = ctx.balanced_shard(num_heads)
        self.q_range = (q_start * head_dim, q_stop * head_dim)
        self.kv_heads = local_kv_heads(num_heads, num_kv_heads, ctx)
        self.num_local_heads = q_stop - q_start
        self.num_local_kv_heads = len(self.kv_heads)
        local = (self.num_local_heads + 2 * self.num_local_kv_heads) * head_dim
        self.weight = _empty(local, hidden_size, dtype=dtype, device=device)
        self.bias = _empty(local, dtype=dtype, device=device) if bias else None

    def load(self, weights: WeightSource, prefixes: Sequence[str]) -> None:
        """``prefixes`` = (q_proj, k_proj, v_proj) names without ``.weight``."""
        q, k, v = prefixes
        d = self.head_dim
        kv_rows = [(h * d, (h + 1) * d) for h in self.kv_heads]
        self._load_rows(weights, [(q, [self.q_range]), (k, kv_rows), (v, kv_rows)])


class RowParallelLinear(_Packable):
    """``y = all_reduce(x_local W_localᵀ) + b``: keeps columns ``[start, stop)`` of ``W``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        in_range: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.in_range = in_range or ctx.shard(in_features, "input features")
        local_in = self.in_range[1] - self.in_range[0]
        self.weight = _empty(out_features, local_in, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    lora: LoraHook | None = None  # multi-LoRA deltas (genserve.model.lora), when enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ctx.world_size == 1:
            y1 = _linear(self, x, self.bias)
            return y1 if self.lora is None else self.lora.add_delta(x, y1)
        # The bias is added once, after the partial sums are reduced; a LoRA delta (A split
        # on the input features like W) is a partial sum too and joins the same all-reduce.
        partial = _linear(self, x, None)
        if self.lora is not None:
            partial = self.lora.add_delta(x, partial)
        y = self.ctx.all_reduce(partial)
        return y if self.bias is None else y + self.bias

    def load(self, weights: WeightSource, prefix: str) -> None:
        start, stop = self.in_range
        if self.quant is None:  # else already given quantized (GGUF blocks)
            w = weights.get_slice(f"{prefix}.weight", 1, start, stop)
            _copy_in(self.weight, w, f"{prefix}.weight")
        if self.bias is not None:
            _copy_in(self.bias, weights.get(f"{prefix}.bias"), f"{prefix}.bias")


class VocabParallelEmbedding(_Packable):
    """Token embedding with the vocabulary split across ranks (padded to equal shares)."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.ctx = ctx
        self.vocab_size = vocab_size
        self.start, self.stop, per_rank = ctx.padded_shard(vocab_size)
        self.weight = _empty(per_rank, hidden_size, dtype=dtype, device=device)
        self._row_cache = DequantizedRowCache()  # a quantized table's decode rows

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:  # dequantize just the looked-up rows
            quant = self.quant
            return self._row_cache.lookup(
                quant, ids, self.weight.dtype, lambda i, d: quant.rows(i).dequantize(d)
            )
        if self.qpanels is not None:  # a tied head's panels (weight_panels.py)
            q = self.qpanels
            return self._row_cache.lookup(q, ids, self.weight.dtype, q.dequantize_rows)
        if self.panels is not None:
            return float_panel_rows(self.panels, ids)
        return F.embedding(ids, self.weight)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        # token_ids: [num_tokens] -> [num_tokens, hidden]
        if self.ctx.world_size == 1:
            return self._lookup(token_ids)
        outside = (token_ids < self.start) | (token_ids >= self.stop)
        local = (token_ids - self.start).masked_fill(outside, 0)
        out = self._lookup(local).masked_fill(outside[:, None], 0.0)
        return self.ctx.all_reduce(out)

    def load(self, weights: WeightSource, name: str) -> None:
        if self.quant is not None:  # already given quantized (GGUF blocks)
            return
        rows = weights.get_slice(name, 0, self.start, self.stop)
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: rows.shape[0]].copy_(rows)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its vocabulary slice and the
    slices are gathered, so every rank returns full ``[num_rows, vocab_size]`` logits."""

    # Half-precision weights on CPU without genserve's kernels: a float32 copy (set by
    # ``pack``), so the head's products come out in float32 without a conversion per step.
    float_weight: torch.Tensor | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[num_rows, vocab_size]`` logits of ``hidden`` ``[num_rows, hidden]``,
        whatever the model's dtype: the products are summed in float32 and handed on
        unrounded, so the sampler and logprobs never see logits rounded to bfloat16
        (whose steps near 20 are 0.125 wide and tie candidates that differ)."""
        local = self._float32_logits(hidden)
        if self.ctx.world_size == 1:
            return local
        return self.ctx.all_gather(local, dim=-1)[:, : self.vocab_size]

    def _float32_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()  # [num_rows, hidden]: the final norm's output, widened exactly
        if self.qpanels is not None:
            return self.qpanels.linear(x, None)  # float32 x: float32 out
        if self.quant is not None:
            return F.linear(x, self.quant.dequantize(torch.float32))
        if self.panels is not None:
            out: torch.Tensor = torch.ops.genserve.panel_linear(
                x, self.panels, self.panel_outputs, None
            )
            return out
        if self.float_weight is not None:
            return F.linear(x, self.float_weight)
        weight = self.weight
        if weight.dtype == torch.float32:
            return _linear(self, x, None)
        if self.matvec_rows and weight.numel():  # CPU kernels: float32 x, float32 sums out
            streamed: torch.Tensor = torch.ops.genserve.matvec(x, weight, None)
            return streamed
        if self.gpu_gemv and (tile := self.gpu_gemv.tile_for(hidden.shape[0])):
            return self.gpu_gemv.run(hidden.to(weight.dtype), weight, None, tile)  # float32 out
        if weight.is_cuda:  # cuBLAS sums in float32; out_dtype skips the rounding
            try:
                return torch.mm(hidden.to(weight.dtype), weight.t(), out_dtype=torch.float32)
            except (RuntimeError, TypeError):  # a torch without mm(out_dtype=)
                pass
        return F.linear(x, weight.float())

    def pack(self, release: bool = True) -> None:
        """The head keeps its products in float32: where ``_Packable.pack`` would prepack a
        half-precision weight for oneDNN (whose output is rounded to bfloat16), a float32
        copy is kept instead."""
        if self.quant is not None:
            return
        weight = self.weight
        if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
            self.float_weight = weight.detach().float()
            if release:
                self.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding matrix (tied word embeddings)."""
        self.weight = embedding.weight

    def use_tied_panels(self, embedding: VocabParallelEmbedding) -> None:
        """Pack the shared matrix once for both: the head multiplies by the panels and the
        embedding looks its rows up in them, so the plain copy is freed."""
        self.use_panels()
        if self.panels is not None:
            embedding.panels, embedding.panel_outputs = self.panels, self.panel_outputs
            embedding.weight = self.weight
        if self.qpanels is not None and embedding.quant is not None:
            embedding.qpanels, embedding.quant = self.qpanels, None
