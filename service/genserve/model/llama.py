"""Native paged implementation of the Llama family: Llama (SmolLM2), Mistral, Qwen2.

The three differ only in configuration: Qwen2 has Q/K/V biases, Mistral (and Qwen2's sliding
layers) a sliding attention window; all share RMSNorm, rotary embeddings, grouped-query
attention and a SiLU-gated MLP.  Weight names are those of transformers' checkpoints.

Submodules are invoked with ``.forward(...)``: no hooks are ever registered on them, and
``nn.Module.__call__`` would add a few microseconds to each of the ~10 calls per layer per
step, which on a small model is a visible share of a decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from genserve.model.attention import AttentionMetadata, TorchAttentionMetadata
from genserve.model.config import ModelConfig
from genserve.model.huge_pages import huge_page_region
from genserve.model.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    _Packable,
    apply_rotary,
)
from genserve.model.lora import LoraHook, ModuleSplit, StepAdapters
from genserve.model.weights import WeightSource
from genserve.parallel import ParallelContext

# A matvec row limit no step reaches (decode_layer takes it as an int64).
_EVERY_ROW = 1 << 40


class LlamaAttention(nn.Module):
    fused = False  # genserve's CPU rotary op (see LlamaForCausalLM.use_fused_cpu_ops)

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_windows[layer_idx]
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            ctx,
            dtype,
            device,
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        q_start, q_stop = self.qkv_proj.q_range
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            config.o_bias,
            ctx,
            dtype,
            device,
            in_range=(q_start, q_stop),
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)  # [num_tokens, (h + 2 * kvh) * d]
        # Q and K are rotated together: one set of elementwise ops instead of two.
        qk_in = qkv[:, : (h + kvh) * d].view(num_tokens, h + kvh, d)
        v = qkv[:, (h + kvh) * d :].view(num_tokens, kvh, d)
        slots = meta.fused_kv_slots if self.fused else None
        if slots is not None:  # CPU kernels: rotary and the K/V store in one op
            qk = torch.ops.genserve.rotary_write_kv(qk_in, cos, sin, v, kv_cache, slots)
        else:
            qk = (torch.ops.genserve.rotary if self.fused else apply_rotary)(qk_in, cos, sin)
        q, k = qk[:, :h], qk[:, h:]  # [num_tokens, h, d], [num_tokens, kvh, d]
        if slots is None:
            meta.write_kv(kv_cache, k, v)
        out = meta.attend(q, k, v, kv_cache, self.scale, self.window)  # [num_tokens, h * d]
        return self.o_proj.forward(out)

    def load(self, weights: WeightSource, prefix: str) -> None:
        self.qkv_proj.load(weights, [f"{prefix}.{p}_proj" for p in "qkv"])
        self.o_proj.load(weights, f"{prefix}.o_proj")


class LlamaMLP(nn.Module):
    fused = False  # genserve's CPU silu_and_mul op

    def __init__(
        self, config: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], config.mlp_bias, ctx, dtype, device
        )
        self.local_size = self.gate_up_proj.weight.shape[0] // 2
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, config.mlp_bias, ctx, dtype, device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)  # [num_tokens, 2 * local_intermediate]
        if self.fused:
            return self.down_proj.forward(torch.ops.genserve.silu_and_mul(gate_up))
        gate, up = gate_up[:, : self.local_size], gate_up[:, self.local_size :]
        return self.down_proj.forward(F.silu(gate) * up)

    def load(self, weights: WeightSource, prefix: str) -> None:
        self.gate_up_proj.load(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj.load(weights, f"{prefix}.down_proj")


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


class LlamaDecoderLayer(nn.Module):
    # Set by LlamaForCausalLM.use_fused_cpu_ops (unsharded models), through set_fused_decode.
    fused_decode: FusedDecodeArgs | None = None
    _fused_decode_call: tuple[Any, tuple[Any, ...], tuple[Any, ...]]

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, ctx, dtype, device)
        self.mlp = LlamaMLP(config, ctx, dtype, device)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, kv_cache, meta)
        x, normed = self.post_attention_layernorm.add_forward(h, x)
        return x + self.mlp.forward(normed)

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
        order, minus their Python: kernels/decode_layer_cpu.cpp)."""
        op, head, tail = self._fused_decode_call
        out: torch.Tensor = op(
            x, *head, cos, sin, kv_cache, meta.slots, block_table, meta.decode_context_lens, *tail
        )
        return out

    def set_fused_decode(self, args: FusedDecodeArgs | None) -> None:
        """Use ``genserve::decode_layer`` with ``args`` (None: not at all).  The arguments
        that do not change from step to step are gathered here once: at one stream the op
        runs in ~330 us, and collecting them from the modules each step cost ~10 us."""
        self.fused_decode = args
        if args is None:
            return
        attn = self.self_attn
        head = (self.input_layernorm.weight, self.post_attention_layernorm.weight,
                self.input_layernorm.eps)  # fmt: skip
        tail = (attn.scale, -1 if attn.window is None else attn.window, attn.num_heads,
                attn.num_kv_heads, args.weights, args.bits, args.groups, args.outs, args.biases,
                args.matvec_rows)  # fmt: skip
        # The overload itself: torch.ops' packet would resolve it again on every call.
        self._fused_decode_call = (torch.ops.genserve.decode_layer.default, head, tail)

    def load(self, weights: WeightSource, prefix: str) -> None:
        self.self_attn.load(weights, f"{prefix}.self_attn")
        self.mlp.load(weights, f"{prefix}.mlp")
        self.input_layernorm.load(weights, f"{prefix}.input_layernorm.weight")
        self.post_attention_layernorm.load(weights, f"{prefix}.post_attention_layernorm.weight")


class LlamaForCausalLM(nn.Module):
    """``forward`` maps a flat token batch to final hidden states; ``compute_logits`` projects
    only the rows that need logits (sampled positions, prompt-logprob positions)."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, ctx, dtype, device
        )
        layers = [
            LlamaDecoderLayer(config, i, ctx, dtype, device) for i in range(config.num_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self._layers = layers  # typed view of the same modules, for the hot loop
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype, device)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        self.num_local_kv_heads = layers[0].self_attn.num_kv_heads
        # Decode-only CPU steps through genserve::decode_layer (set by use_fused_cpu_ops).
        self._decode_layers_fused = False

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``token_ids``, ``positions``: ``[num_tokens]`` → hidden ``[num_tokens, hidden]``
        *before* the final norm (which ``compute_logits`` applies to the rows it needs).
        Writes every token's K/V into ``kv_caches`` (one tensor per layer)."""
        x = self.embed_tokens.forward(token_ids)
        # Decode rows are one sequence each (dynamic RoPE must not merge adjacent ones).
        cos, sin = self.rotary.cos_sin(positions, x.dtype, getattr(meta, "num_decodes", 0))
        if (
            self._decode_layers_fused
            and isinstance(meta, TorchAttentionMetadata)
            and meta.use_cpu_kernel
            and not meta.prefills
            and meta.num_decodes == token_ids.shape[0]
        ):
            table = meta.decode_blocks.view(meta.num_decodes, meta.decode_max_blocks)
            for layer, kv_cache in zip(self._layers, kv_caches, strict=True):
                x = layer.decode_forward(x, cos, sin, kv_cache, meta, table)
            return x
        for layer, kv_cache in zip(self._layers, kv_caches, strict=True):
            x = layer.forward(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``forward``'s output ``[num_rows, hidden]`` → float32 ``[num_rows,
        vocab_size]``.  The final norm is row-wise, so normalising only these rows is exact."""
        return self.lm_head.logits(self.norm(hidden)).float()

    def pack_weights(self) -> None:
        """Switch every matmul weight to its prepacked form where that is faster (bfloat16
        on CPU; see ``layers._pack_weight``).  Call once, after :meth:`load_weights`."""
        for layer in self._layers:
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            ):
                linear.pack()
        # A tied head shares the embedding's matrix, which the embedding lookup still needs.
        self.lm_head.pack(release=not self.config.tie_word_embeddings)

    def use_fused_cpu_ops(self, matvec_rows: int = 0) -> None:
        """Route norms, rotary and the MLP activation through genserve's one-pass CPU ops
        (``genserve.kernels``; CPU only, where they round as the torch ops do, up to the
        order of float32 sums).  float32 projections run on column panels
        (``kernels/panel_gemm_cpu.cpp``); half-precision steps of at most ``matvec_rows`` rows
        through the weight-streaming matvec kernel.  Call once the kernels are loaded."""
        from genserve.kernels import cpu as cpu_kernels

        if self.lm_head.weight.dtype == torch.float16 or cpu_kernels.batch_invariant():
            # float16: torch's CPU GEMM has no fast float16 path to hand larger steps to.
            # --deterministic: one kernel for every row count, so a row's sums never
            # depend on how many rows share its step.
            matvec_rows = _EVERY_ROW
        for layer in self._layers:
            layer.input_layernorm.fused = True
            layer.post_attention_layernorm.fused = True
            layer.self_attn.fused = True
            layer.mlp.fused = True
            for linear in self._linears(layer):
                linear.matvec_rows = matvec_rows
        self.norm.fused = True
        # The head's logits are float32 from the matvec at any row count (layers.py).
        self.lm_head.matvec_rows = _EVERY_ROW
        # float32 and quantized weights move to the column-panel layout every step size runs
        # on (the kernel's one copy replaces the plain one; half precision keeps matvec).
        with torch.inference_mode():
            for layer in self._layers:
                for linear in self._linears(layer):
                    linear.use_panels()
            if self.config.tie_word_embeddings:
                self.lm_head.use_tied_panels(self.embed_tokens)
            else:
                self.lm_head.use_panels()
        self._move_streamed_weights_to_huge_pages()
        # Decode-only steps run each layer as one C++ op where no rank has to all-reduce
        # between its projections.
        if self.lm_head.ctx.world_size == 1:
            for layer in self._layers:
                layer.set_fused_decode(FusedDecodeArgs.of(self._linears(layer)))
            self._decode_layers_fused = all(layer.fused_decode for layer in self._layers)

    def _move_streamed_weights_to_huge_pages(self) -> None:
        """Copy every weight a decode step streams into one region of 2 MiB pages
        (``model/huge_pages.py``; nothing where THP is not in madvise mode).  A tied
        embedding follows its head to the copies."""
        holders: list[_Packable] = [
            linear for layer in self._layers for linear in self._linears(layer)
        ]
        holders.append(self.lm_head)
        with (
            torch.inference_mode(),
            huge_page_region(
                [t.nbytes for holder in holders for t in holder.streamed_weights()],
                self.lm_head.weight.device,
            ) as region,
        ):
            if region is None:
                return
            embed, head = self.embed_tokens, self.lm_head
            shared = [
                attr
                for attr in ("weight", "panels", "qpanels")
                if getattr(head, attr) is not None and getattr(embed, attr) is getattr(head, attr)
            ]
            for holder in holders:
                holder.move_streamed_weights(region)
            for attr in shared:
                setattr(embed, attr, getattr(head, attr))

    @staticmethod
    def _linears(layer: LlamaDecoderLayer) -> tuple[_Packable, ...]:
        attn, mlp = layer.self_attn, layer.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def enable_lora(self, step: StepAdapters) -> dict[str, tuple[LoraHook, ModuleSplit]]:
        """Attach a LoRA hook to every adaptable projection; returns, per PEFT module path
        (``model.layers.{i}.self_attn.q_proj``), the hook and how this rank slices it."""
        targets: dict[str, tuple[LoraHook, ModuleSplit]] = {}
        self._decode_layers_fused = False  # the fused layer op has no LoRA deltas
        for i, layer in enumerate(self._layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            for linear in (qkv, o, gate_up, down):
                linear.lora = LoraHook(step)
            d = qkv.head_dim
            q_rows = (qkv.q_range,)
            kv_rows = tuple((h * d, (h + 1) * d) for h in qkv.kv_heads)
            q_size = qkv.num_local_heads * d
            kv_size = qkv.num_local_kv_heads * d
            prefix = f"model.layers.{i}"
            assert qkv.lora is not None and o.lora is not None
            assert gate_up.lora is not None and down.lora is not None
            targets[f"{prefix}.self_attn.q_proj"] = (qkv.lora, ModuleSplit(q_rows, 0))
            targets[f"{prefix}.self_attn.k_proj"] = (qkv.lora, ModuleSplit(kv_rows, q_size))
            targets[f"{prefix}.self_attn.v_proj"] = (
                qkv.lora,
                ModuleSplit(kv_rows, q_size + kv_size),
            )
            hidden = self.config.hidden_size
            targets[f"{prefix}.self_attn.o_proj"] = (
                o.lora,
                ModuleSplit(((0, hidden),), 0, o.in_range),
            )
            gate_r, up_r = gate_up.ranges
            targets[f"{prefix}.mlp.gate_proj"] = (gate_up.lora, ModuleSplit((gate_r,), 0))
            targets[f"{prefix}.mlp.up_proj"] = (
                gate_up.lora,
                ModuleSplit((up_r,), gate_r[1] - gate_r[0]),
            )
            targets[f"{prefix}.mlp.down_proj"] = (
                down.lora,
                ModuleSplit(((0, hidden),), 0, down.in_range),
            )
        return targets

    @torch.no_grad()
    def load_weights(self, weights: WeightSource) -> None:
        """Load this rank's shard of every tensor, converting to the model dtype."""
        self.embed_tokens.load(weights, "model.embed_tokens.weight")
        for i, layer in enumerate(self._layers):
            layer.load(weights, f"model.layers.{i}")
        self.norm.load(weights, "model.norm.weight")
        if not self.config.tie_word_embeddings:
            self.lm_head.load(weights, "lm_head.weight")
