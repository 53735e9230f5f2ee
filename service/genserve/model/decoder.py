"""The native decoder: a causal LM assembled from parts as a :class:`ModelConfig` spec says.

Every dense family genserve serves natively (``model/families``) is this one module with a
different spec: norm kind, attention options (biases, q/k norm, soft-cap, scale, sliding
window and rotary per layer), MLP kind, how the sublayers meet the residual stream, and the
embedding / logit multipliers.  Weight names are the family's (``spec.WeightNames``).

Submodules are invoked with ``.forward(...)``: no hooks are ever registered on them, and
``nn.Module.__call__`` would add a few microseconds to each of the ~10 calls per layer per
step, which on a small model is a visible share of a decode step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn

from genserve.kernels import fused_gpu_ops
from genserve.model.attention import AttentionMetadata, TorchAttentionMetadata
from genserve.model.fused_decode import FusedDecodeArgs, layer_options
from genserve.model.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    _Packable,
)
from genserve.model.mla import LatentAttention
from genserve.model.moe import SparseMoeBlock
from genserve.model.norms import LayerNorm, Norm, RMSNorm, make_norm
from genserve.model.rotary import RotaryAngles, apply_rotary, head_permutation
from genserve.model.spec import Activation, ModelConfig, QKNorm, QKVLayout, UnsupportedModelError
from genserve.model.weight_views import RowView, RowViews, head_rows
from genserve.model.weights import WeightSource
from genserve.parallel import ParallelContext

log = structlog.get_logger("genserve.model")


class Attention(nn.Module):
    fused = False  # genserve's CPU rotary op (see DecoderForCausalLM.use_fused_cpu_ops)

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        spec = config.attention
        d = config.head_dim
        self.config = config
        self.head_dim = d
        self.scale = spec.scale if spec.scale is not None else d**-0.5
        self.softcap = spec.softcap
        self.window = config.sliding_windows[layer_idx]
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, d, config.num_heads, config.num_kv_heads, spec.qkv_bias,
            ctx, dtype, device,
        )  # fmt: skip
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        q_start, q_stop = self.qkv_proj.q_range
        self.o_proj = RowParallelLinear(
            config.num_heads * d, config.hidden_size, spec.o_bias, ctx, dtype, device,
            in_range=(q_start, q_stop),
        )  # fmt: skip
        self.perm = head_permutation(d, spec.rotary_dim or d, spec.interleaved_rotary)
        # gpt-oss's sink logits of this shard's query heads, float32 as the softmax is.
        self.sinks = (
            nn.Parameter(torch.zeros(self.num_heads, device=device), requires_grad=False)
            if spec.sinks
            else None
        )
        self.qk_norm = spec.qk_norm
        self.q_norm: Norm | None = None
        self.k_norm: Norm | None = None
        if spec.qk_norm is QKNorm.FULL_WIDTH:
            if ctx.world_size > 1:
                raise UnsupportedModelError("a full-width q/k norm cannot be sharded")
            self.q_norm = make_norm(spec.qk_norm_spec, (self.num_heads * d,), dtype, device)
            self.k_norm = make_norm(spec.qk_norm_spec, (self.num_kv_heads * d,), dtype, device)
        elif spec.qk_norm is QKNorm.PER_HEAD:
            # Cohere keeps one weight row per head; the others share one over head_dim.
            per_head = spec.qk_norm_weights_per_head
            q_shape = (self.num_heads, d) if per_head else (d,)
            k_shape = (self.num_kv_heads, d) if per_head else (d,)
            self.q_norm = make_norm(spec.qk_norm_spec, q_shape, dtype, device)
            self.k_norm = make_norm(spec.qk_norm_spec, k_shape, dtype, device)

    def linears(self) -> tuple[_Packable, ...]:
        return self.qkv_proj, self.o_proj

    def norms(self) -> list[Norm]:
        """The q/k norms, where the spec has them."""
        return [n for n in (self.q_norm, self.k_norm) if n is not None]

    def _qk_v(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The projection's Q and K heads (q/k-normed where the spec says), ``[num_tokens,
        h + kvh, d]``, and V ``[num_tokens, kvh, d]`` (views of the projection's output)."""
        num_tokens = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # [num_tokens, (h + 2 * kvh) * d]
        # Q and K are rotated together: one set of elementwise ops instead of two.
        if self.q_norm is None or self.k_norm is None:
            qk_in = qkv[:, : (h + kvh) * d].view(num_tokens, h + kvh, d)
        elif self.qk_norm is QKNorm.FULL_WIDTH:
            q = self.q_norm.forward(qkv[:, : h * d])
            k = self.k_norm.forward(qkv[:, h * d : (h + kvh) * d])
            qk_in = torch.cat((q, k), dim=1).view(num_tokens, h + kvh, d)
        else:
            q = self.q_norm.forward(qkv[:, : h * d].view(num_tokens, h, d))
            k = self.k_norm.forward(qkv[:, h * d : (h + kvh) * d].view(num_tokens, kvh, d))
            qk_in = torch.cat((q, k), dim=1)  # [num_tokens, h + kvh, d]
        return qk_in, qkv[:, (h + kvh) * d :].view(num_tokens, kvh, d)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.num_heads
        qk_in, v = self._qk_v(x)
        slots = meta.fused_kv_slots if self.fused else None
        if slots is not None:  # CPU kernels: rotary and the K/V store in one op
            qk = torch.ops.genserve.rotary_write_kv(qk_in, cos, sin, v, kv_cache, slots)
        else:
            qk = (torch.ops.genserve.rotary if self.fused else apply_rotary)(qk_in, cos, sin)
        q, k = qk[:, :h], qk[:, h:]  # [num_tokens, h, d], [num_tokens, kvh, d]
        if slots is None:
            meta.write_kv(kv_cache, k, v)
        out = meta.attend(q, k, v, kv_cache, self.scale, self.window, self.softcap, self.sinks)
        return self.o_proj.forward(out)  # out: [num_tokens, h * d]

    def forward_gpu(
        self,
        x: torch.Tensor,
        angles: RotaryAngles | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """:meth:`forward` with rotary and the K/V store as one fused op
        (``genserve_gpu::rotary_store_kv``, rotating Q and K in place); ``angles`` None: a
        layer without rotary."""
        h = self.num_heads
        qk, v = self._qk_v(x)
        cos, sin, positions = (None, None, None) if angles is None else (
            angles.cos, angles.sin, angles.positions
        )  # fmt: skip
        fused_gpu_ops.rotary_store_kv(
            qk, v, cos, sin, positions, meta.slots, kv_cache, meta.kv_layout
        )
        out = meta.attend(
            qk[:, :h], qk[:, h:], v, kv_cache, self.scale, self.window, self.softcap, self.sinks
        )
        return self.o_proj.forward(out)  # out: [num_tokens, h * d]

    def load(self, weights: WeightSource, prefix: str) -> None:
        n, d = self.config.names, self.head_dim
        num_heads, num_kv = self.config.num_heads, self.config.num_kv_heads
        q, k, v = (f"{prefix}.{name}" for name in (n.q, n.k, n.v))
        perm = self.perm
        if n.qkv_layout is QKVLayout.SEPARATE:
            parts = [(q, head_rows(num_heads, d, perm)), (k, head_rows(num_kv, d, perm)),
                     (v, None)]  # fmt: skip
        elif n.qkv_layout is QKVLayout.FUSED:  # [q | k | v] rows
            kv_at = num_heads * d
            parts = [(q, head_rows(num_heads, d, perm)), (q, head_rows(num_kv, d, perm, kv_at)),
                     (q, head_rows(num_kv, d, None, kv_at + num_kv * d))]  # fmt: skip
        else:  # per head [q k v]: head i's q rows start at 3 i d, its k at 3 i d + d, ...
            starts = torch.arange(num_heads)[:, None] * 3 * d
            parts = []
            for j, order in enumerate((perm, perm, None)):
                inner = torch.tensor(order) if order else torch.arange(d)
                parts.append((q, (starts + j * d + inner[None, :]).reshape(-1)))
        views = {}
        for role, (source, rows) in zip("qkv", parts, strict=True):
            for suffix in ("weight", "bias"):
                views[f"{role}.{suffix}"] = RowView(f"{source}.{suffix}", rows)
        self.qkv_proj.load(RowViews(weights, views), ["q", "k", "v"])
        self.o_proj.load(weights, f"{prefix}.{n.o}")
        if self.sinks is not None:
            start, stop = self.qkv_proj.q_range  # rows of the local query heads
            self.sinks.copy_(weights.get_slice(f"{prefix}.{n.sinks}", 0, start // d, stop // d))
        if self.q_norm is not None and self.k_norm is not None:
            self._load_qk_norms(weights, prefix)

    def _load_qk_norms(self, weights: WeightSource, prefix: str) -> None:
        n, d = self.config.names, self.head_dim
        cols = torch.tensor(self.perm) if self.perm else None
        full_width = self.qk_norm is QKNorm.FULL_WIDTH
        q_heads = torch.arange(*self.qkv_proj.q_range)[::d] // d  # local query heads
        kv_heads = torch.tensor(self.qkv_proj.kv_heads)
        views = {}
        for role, name, heads in (("q", n.q_norm, q_heads), ("k", n.k_norm, kv_heads)):
            rows = heads if self.config.attention.qk_norm_weights_per_head else None
            role_cols = cols
            if full_width and cols is not None:  # one weight over every head: permute each
                role_cols = (torch.arange(len(heads))[:, None] * d + cols[None, :]).reshape(-1)
            for suffix in ("weight", "bias"):
                views[f"{role}.{suffix}"] = RowView(f"{prefix}.{name}.{suffix}", rows, role_cols)
        viewed = RowViews(weights, views)
        assert self.q_norm is not None and self.k_norm is not None
        self.q_norm.load(viewed, "q.weight")
        self.k_norm.load(viewed, "k.weight")


class MLP(nn.Module):
    fused = False  # genserve's CPU silu_and_mul op
    # genserve_gpu::gated_act's name for the activation (use_fused_gpu_ops; None: eager).
    gpu_activation: str | None = None

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        spec = config.mlp
        size, hidden = config.intermediate_size, config.hidden_size
        self.config = config
        self.gated = spec.gated
        self.activation = spec.activation
        sizes = [size, size] if spec.gated else [size]
        self.gate_up_proj: ColumnParallelLinear = MergedColumnParallelLinear(
            hidden, sizes, spec.bias, ctx, dtype, device
        )
        self.local_size = self.gate_up_proj.weight.shape[0] // len(sizes)
        self.down_proj = RowParallelLinear(size, hidden, spec.bias, ctx, dtype, device)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation is Activation.SILU:
            return F.silu(x)
        approximate = "tanh" if self.activation is Activation.GELU_TANH else "none"
        return F.gelu(x, approximate=approximate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [num_tokens, (1 or 2) * local_intermediate]
        if not self.gated:
            return self.down_proj.forward(self._act(gate_up))
        if self.fused and self.activation is Activation.SILU:
            return self.down_proj.forward(torch.ops.genserve.silu_and_mul(gate_up))
        if self.gpu_activation is not None:
            return self.down_proj.forward(fused_gpu_ops.gated_act(gate_up, self.gpu_activation))
        gate, up = gate_up[:, : self.local_size], gate_up[:, self.local_size :]
        return self.down_proj.forward(self._act(gate) * up)

    def linears(self) -> tuple[_Packable, ...]:
        return self.gate_up_proj, self.down_proj

    def load(self, weights: WeightSource, prefix: str) -> None:
        n = self.config.names
        up = f"{prefix}.{n.up}"
        if not self.gated:
            self.gate_up_proj.load(weights, [up])
        elif n.gate:
            self.gate_up_proj.load(weights, [f"{prefix}.{n.gate}", up])
        else:  # one [gate | up] matrix (Phi-3's gate_up_proj)
            size = self.config.intermediate_size
            views = {
                f"{role}.{suffix}": RowView(
                    f"{up}.{suffix}", torch.arange(i * size, (i + 1) * size)
                )
                for i, role in enumerate(("gate", "up"))
                for suffix in ("weight", "bias")
            }
            self.gate_up_proj.load(RowViews(weights, views), ["gate", "up"])
        self.down_proj.load(weights, f"{prefix}.{n.down}")


def _use_gpu_activation(mlp: MLP) -> None:
    """The fused GPU gated activation for ``mlp`` where it has one of its activations."""
    if mlp.gated and mlp.activation in (Activation.SILU, Activation.GELU_TANH):
        mlp.gpu_activation = "silu" if mlp.activation is Activation.SILU else "gelu_tanh"


def _make_mlp(
    config: ModelConfig, layer_idx: int, ctx: ParallelContext, dtype: torch.dtype,
    device: torch.device,
) -> MLP | SparseMoeBlock:  # fmt: skip
    """The layer's dense MLP, or its mixture of experts where the spec has one there."""
    moe = config.moe
    if moe is None or not moe.layers[layer_idx]:
        return MLP(config, ctx, dtype, device)
    shared = None
    if moe.shared_intermediate_size:
        # The shared expert is a dense MLP of its own width under its own names.
        names = replace(
            config.names,
            gate=f"{moe.names.shared}.gate_proj",
            up=f"{moe.names.shared}.up_proj",
            down=f"{moe.names.shared}.down_proj",
        )
        shared_config = replace(config, intermediate_size=moe.shared_intermediate_size, names=names)
        shared = MLP(shared_config, ctx, dtype, device)
    return SparseMoeBlock(config, ctx, dtype, device, shared)


class DecoderLayer(nn.Module):
    # Set by DecoderForCausalLM.use_fused_cpu_ops (unsharded models), through set_fused_decode.
    fused_decode: FusedDecodeArgs | None = None
    fused_decode_call: tuple[Any, tuple[Any, ...], tuple[Any, ...]]
    _moe_decode_op: Any  # genserve::decode_moe_layer, resolved once (see set_fused_decode)

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.block = config.block
        self.llama_block = config.block.is_llama
        self.rope_index = config.rope_index(layer_idx)
        self.self_attn: Attention | LatentAttention = (
            Attention(config, layer_idx, ctx, dtype, device)
            if config.mla is None
            else LatentAttention(config, layer_idx, ctx, dtype, device)
        )
        self.mlp: MLP | SparseMoeBlock = _make_mlp(config, layer_idx, ctx, dtype, device)
        hidden = (config.hidden_size,)
        b = config.block

        def norm(present: bool) -> Norm | None:
            return make_norm(config.norm, hidden, dtype, device) if present else None

        self.pre_attn_norm = norm(b.pre_attn_norm)
        self.post_attn_norm = norm(b.post_attn_norm)
        self.pre_mlp_norm = norm(b.pre_mlp_norm)
        self.post_mlp_norm = norm(b.post_mlp_norm)

    def norms(self) -> list[Norm]:
        held = (self.pre_attn_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm)
        return [n for n in held if n is not None]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        if self.llama_block:  # the common case, with the residual add fused into the norm
            assert self.pre_attn_norm is not None and self.pre_mlp_norm is not None
            h = attn.forward(self.pre_attn_norm.forward(x), cos, sin, kv_cache, meta)
            x, normed = self.pre_mlp_norm.add_forward(h, x)
            return x + mlp.forward(normed)
        attn_in = x if self.pre_attn_norm is None else self.pre_attn_norm.forward(x)
        h = attn.forward(attn_in, cos, sin, kv_cache, meta)
        if self.block.parallel:
            mlp_in = attn_in if self.pre_mlp_norm is None else self.pre_mlp_norm.forward(x)
            return x + h + mlp.forward(mlp_in)
        scale = self.block.residual_multiplier
        if self.post_attn_norm is not None:
            h = self.post_attn_norm.forward(h)
        x = x + (h if scale == 1.0 else h * scale)
        m = mlp.forward(x if self.pre_mlp_norm is None else self.pre_mlp_norm.forward(x))
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm.forward(m)
        return x + (m if scale == 1.0 else m * scale)

    def forward_carry(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        angles: RotaryAngles | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fused GPU path's layer (``use_fused_gpu_ops``): the layer's input is ``x +
        residual`` (``x`` alone when ``residual`` is None) and so is its output, returned as
        ``(x, residual)``.  Sequential blocks hand their residual stream on unsummed, so that
        each add lands in the next fused add + RMSNorm (vLLM's scheme): a Llama layer is nine
        launches.  Parallel blocks (attention and MLP side by side) sum as the eager path
        does and return ``(output, None)``.  Every sum is the eager path's, in its order."""
        attn, mlp, block = self.self_attn, self.mlp, self.block
        assert isinstance(attn, Attention)  # use_fused_gpu_ops is not set for latent attention
        if self.pre_attn_norm is None:
            if residual is not None:
                x = x + residual
            attn_in = x
        elif residual is None:
            attn_in = self.pre_attn_norm.forward(x)
        else:
            x, attn_in = self.pre_attn_norm.add_forward(x, residual)
        h = attn.forward_gpu(attn_in, angles, kv_cache, meta)
        if block.parallel:
            mlp_in = attn_in if self.pre_mlp_norm is None else self.pre_mlp_norm.forward(x)
            return x + h + mlp.forward(mlp_in), None
        scale = block.residual_multiplier
        if self.post_attn_norm is not None:
            h = self.post_attn_norm.forward(h)
        h = h if scale == 1.0 else h * scale
        if self.pre_mlp_norm is None:
            x = x + h
            mlp_in = x
        else:
            x, mlp_in = self.pre_mlp_norm.add_forward(h, x)
        m = mlp.forward(mlp_in)
        if self.post_mlp_norm is not None:
            m = self.post_mlp_norm.forward(m)
        return (m if scale == 1.0 else m * scale), x

    def use_fused_gpu_ops(self) -> str | None:
        """Route this layer's RMSNorms, gated activation and rotary + K/V store through the
        fused GPU ops (``kernels/fused_gpu_ops.py``), and a mixture of experts' routed
        experts through its Triton kernels (``kernels/triton_moe.py``); called by the model
        on CUDA.  Returns why the routed experts stay on the torch loop, or None."""
        for norm in [*self.norms(), *self.self_attn.norms()]:  # q/k norms: full or per head
            if isinstance(norm, RMSNorm):
                norm.gpu_fused = True
        mlp = self.mlp
        if isinstance(mlp, MLP):
            _use_gpu_activation(mlp)
            return None
        if isinstance(mlp.shared, MLP):
            _use_gpu_activation(mlp.shared)
        return mlp.use_fused_gpu_ops()

    def decode_forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`forward` of a decode-only CPU step as one C++ op (the same ops in the same
        order, minus their Python: kernels/decode_layer_cpu.cpp).  A mixture-of-experts layer:
        attention half, router and routed experts as one op (``genserve::decode_moe_layer``),
        any shared expert after it; experts off the CPU kernels: the attention half alone, then
        the experts as :meth:`forward` runs them.  The same sums in the same order every way."""
        op, head, tail = self.fused_decode_call
        args = (x, *head, cos, sin, kv_cache, meta.slots, block_table, meta.decode_context_lens,
                *tail)  # fmt: skip
        mlp = self.mlp
        if isinstance(mlp, MLP):  # decode_layer: the whole layer
            out: torch.Tensor = op(*args)
            return out
        moe_args = mlp.decode_args()
        if moe_args is None:  # decode_attention: (x + h, pre_mlp_norm(x + h))
            summed, normed = op(*args)
            moe_out: torch.Tensor = summed + mlp.forward(normed)
            return moe_out
        out, normed, routed = self._moe_decode_op(*args, *moe_args)
        # Without a shared expert `out` is x + h + routed already (the op's add_routed).
        return out if mlp.shared is None else out + (routed + mlp.shared_output(normed))

    def set_fused_decode(self, args: FusedDecodeArgs | None) -> None:
        """Use ``genserve::decode_layer`` with ``args`` (None: not at all).  The arguments
        that do not change from step to step are gathered here once: at one stream the op
        runs in ~330 us, and collecting them from the modules each step cost ~10 us."""
        self.fused_decode = args
        if args is None:
            return
        attn = self.self_attn
        assert isinstance(attn, Attention)  # fused_decode.unsupported_reason refuses the rest
        norms: list[torch.Tensor | None] = []
        held = (self.pre_attn_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm)
        for norm in (*held, attn.q_norm, attn.k_norm):  # the op's NormSlot order
            norms.append(None if norm is None else norm.weight)
            norms.append(norm.bias if isinstance(norm, LayerNorm) else None)
        options, scalars = layer_options(self.config, attn.scale)
        head = (norms, options, scalars)
        tail = (-1 if attn.window is None else attn.window, attn.num_heads, attn.num_kv_heads,
                args.weights, args.bits, args.groups, args.outs, args.biases,
                args.matvec_rows)  # fmt: skip
        # The overload itself: torch.ops' packet would resolve it again on every call.
        ops = torch.ops.genserve
        whole = isinstance(self.mlp, MLP)  # else its attention half (fused_decode.py)
        op = ops.decode_layer.default if whole else ops.decode_attention.default
        self.fused_decode_call = (op, head, tail)
        self._moe_decode_op = ops.decode_moe_layer.default

    def load(self, weights: WeightSource, prefix: str) -> None:
        n = self.config.names
        self.self_attn.load(weights, prefix)
        self.mlp.load(weights, prefix)
        for norm, name in (
            (self.pre_attn_norm, n.pre_attn_norm),
            (self.post_attn_norm, n.post_attn_norm),
            (self.pre_mlp_norm, n.pre_mlp_norm),
            (self.post_mlp_norm, n.post_mlp_norm),
        ):
            if norm is not None:
                norm.load(weights, f"{prefix}.{name}.weight")
