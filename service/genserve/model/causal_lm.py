"""The native causal LM: embeddings, the decoder layers (``model/decoder.py``), the final
norm and the LM head, with the CPU fast paths (column panels, fused ops, the one-op decode
layer), quantized weights and LoRA hooks, for any spec the families produce."""

from __future__ import annotations

from typing import Any

import structlog
import torch
from torch import nn

from genserve.model.attention import AttentionMetadata, TorchAttentionMetadata
from genserve.model.decoder import MLP, Attention, DecoderLayer
from genserve.model.fused_decode import FusedDecodeArgs, decode_stack, unsupported_reason
from genserve.model.huge_pages import huge_page_region, release_freed_heap
from genserve.model.layers import ParallelLMHead, VocabParallelEmbedding, _Packable
from genserve.model.lora import LoraHook, ModuleSplit, StepAdapters
from genserve.model.moe import SparseMoeBlock
from genserve.model.norms import RMSNorm, make_norm
from genserve.model.rotary import RotaryAngles, RotaryEmbedding, identity_cos_sin
from genserve.model.spec import ModelConfig, UnsupportedModelError
from genserve.model.weights import WeightSource
from genserve.parallel import ParallelContext

log = structlog.get_logger("genserve.model")

# A matvec row limit no step reaches (decode_layer takes it as an int64).
_EVERY_ROW = 1 << 40


class DecoderForCausalLM(nn.Module):
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
        # transformers scales in the weights' dtype (Gemma: a tensor of sqrt(hidden)).
        self.embed_scale = torch.tensor(config.embed_scale, dtype=dtype, device=device)
        layers = [DecoderLayer(config, i, ctx, dtype, device) for i in range(config.num_layers)]
        self.layers = nn.ModuleList(layers)
        self._layers = layers  # typed view of the same modules, for the hot loop
        self.norm = make_norm(config.norm, (config.hidden_size,), dtype, device)
        rotary_dim = config.attention.rotary_dim
        ropes = [config.rope] + ([config.local_rope] if config.local_rope is not None else [])
        rotaries = [RotaryEmbedding(rope, config.head_dim, device, rotary_dim) for rope in ropes]
        self.rotaries = nn.ModuleList(rotaries)
        self._rotaries = rotaries  # typed view
        self._needs_lengths = any(r.needs_lengths for r in rotaries)
        # Per layer, its rotary embedding's index; a no-rope layer's is one past the last.
        self._layer_tables = [
            len(rotaries) if i is None else i
            for i in map(config.rope_index, range(config.num_layers))
        ]
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, ctx, dtype, device)
        self.lm_head_bias: torch.Tensor | None = None
        if config.names.lm_head_bias:
            bias = torch.empty(config.vocab_size, dtype=dtype, device=device)
            self.lm_head_bias = nn.Parameter(bias, requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.embed_tokens)
        self.num_local_kv_heads = layers[0].self_attn.num_kv_heads
        # Decode-only CPU steps through genserve::decode_layer (set by use_fused_cpu_ops),
        # all layers in one genserve::decode_layers call where each is a whole-layer op.
        self._decode_layers_fused = False
        self._decode_stack: torch.ScriptObject | None = None
        self._decode_layers_op: Any = None  # genserve::decode_layers, resolved once
        # The fused GPU layer ops (set by use_fused_gpu_ops): per rotary embedding, its
        # cos/sin table by position, or None where angles are computed per step.
        self._gpu_fused = False
        self._gpu_tables: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    @property
    def rotary(self) -> RotaryEmbedding:
        """The global layers' rotary embedding."""
        return self._rotaries[0]

    def _angle_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This step's cos/sin of each rotary embedding, then the identity's where some
        layer has no rotary: layer i rotates by entry ``self._layer_tables[i]``."""
        lengths = meta.sequence_lengths() if self._needs_lengths else None
        tables = [r.cos_sin(positions, dtype, lengths) for r in self._rotaries]
        if len(self._rotaries) < max(self._layer_tables) + 1:  # no-rope layers: identity
            n, d = positions.shape[0], self.config.head_dim
            tables.append(identity_cos_sin(n, d, dtype, positions.device))
        return tables

    def _angles(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the cos/sin it rotates by (shared objects: computed once per step)."""
        tables = self._angle_tables(positions, dtype, meta)
        return [tables[i] for i in self._layer_tables]

    def _gpu_angles(
        self, positions: torch.Tensor, dtype: torch.dtype, meta: AttentionMetadata
    ) -> list[RotaryAngles | None]:
        """Per layer, the angles the fused GPU rotary reads (None: a no-rope layer): the
        load-time table indexed by position, or this step's angles where they depend on
        sequence lengths."""
        lengths = meta.sequence_lengths() if self._needs_lengths else None
        angles: list[RotaryAngles | None] = []
        for rotary, table in zip(self._rotaries, self._gpu_tables, strict=True):
            if table is not None:
                angles.append(RotaryAngles(table[0], table[1], positions))
            else:
                cos, sin = rotary.half_angles(positions, dtype, lengths)
                angles.append(RotaryAngles(cos, sin, None))
        angles.append(None)  # index len(rotaries): layers without rotary
        return [angles[i] for i in self._layer_tables]

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
        if self.config.embed_scale != 1.0:
            x = x * self.embed_scale
        if self._gpu_fused:
            residual: torch.Tensor | None = None
            gpu_angles = self._gpu_angles(positions, x.dtype, meta)
            for layer, kv_cache, layer_angles in zip(
                self._layers, kv_caches, gpu_angles, strict=True
            ):
                x, residual = layer.forward_carry(x, residual, layer_angles, kv_cache, meta)
            return x if residual is None else residual + x
        if (
            self._decode_layers_fused
            and isinstance(meta, TorchAttentionMetadata)
            and meta.use_cpu_kernel
            and not meta.prefills
            and meta.num_decodes == token_ids.shape[0]
        ):
            table = meta.decode_blocks.view(meta.num_decodes, meta.decode_max_blocks)
            if self._decode_stack is not None:
                tables = self._angle_tables(positions, x.dtype, meta)
                out: torch.Tensor = self._decode_layers_op(
                    x, self._decode_stack, kv_caches, [c for c, _ in tables],
                    [s for _, s in tables], meta.slots, table, meta.decode_context_lens,
                )  # fmt: skip
                return out
            angles = self._angles(positions, x.dtype, meta)
            for layer, kv_cache, (cos, sin) in zip(self._layers, kv_caches, angles, strict=True):
                x = layer.decode_forward(x, cos, sin, kv_cache, meta, table)
            return x
        angles = self._angles(positions, x.dtype, meta)
        for layer, kv_cache, (cos, sin) in zip(self._layers, kv_caches, angles, strict=True):
            x = layer.forward(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows of ``forward``'s output ``[num_rows, hidden]`` → float32 ``[num_rows,
        vocab_size]``.  The final norm is row-wise, so normalising only these rows is exact."""
        logits = self.lm_head.logits(self.norm.forward(hidden))
        if self.lm_head_bias is not None:
            logits = logits + self.lm_head_bias
        c = self.config
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.logit_divisor != 1.0:
            logits = logits / c.logit_divisor
        logits = logits.float()
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits

    def pack_weights(self) -> None:
        """Switch every matmul weight to its prepacked form where that is faster (bfloat16
        on CPU; see ``layers._pack_weight``).  Call once, after :meth:`load_weights`."""
        for layer in self._layers:
            for linear in self._linears(layer):
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
            # The q/k norms too: decode_layer runs them through the same op, so the fused
            # layer and this per-op path give identical results.
            for norm in (*layer.norms(), *layer.self_attn.norms()):
                if norm is not None:
                    norm.fused = isinstance(norm, RMSNorm)
            layer.self_attn.fused = True
            layer.mlp.fused = True
            for linear in self._linears(layer):
                linear.matvec_rows = matvec_rows
        self.norm.fused = isinstance(self.norm, RMSNorm)
        # The head's logits are float32 from the matvec at any row count (layers.py).
        self.lm_head.matvec_rows = _EVERY_ROW
        # float32 and quantized weights move to the column-panel layout every step size runs
        # on (the kernel's one copy replaces the plain one; half precision keeps matvec),
        # and from there to huge pages, one matrix at a time.
        self._pack_streamed_weights()
        # Decode-only steps run each layer as one C++ op where no rank has to all-reduce
        # between its projections, and the op implements the layer's parts.
        reason = unsupported_reason(self.config)
        if reason is None and self.lm_head.ctx.world_size > 1:
            reason = "sharded: each layer all-reduces between its projections"
        if reason is None:
            for layer in self._layers:
                # A MoE layer's op is its attention half (qkv, o): the experts run after it.
                moe = isinstance(layer.mlp, SparseMoeBlock)
                linears = layer.self_attn.linears() if moe else self._linears(layer)
                layer.set_fused_decode(FusedDecodeArgs.of(linears))
            self._decode_layers_fused = all(layer.fused_decode for layer in self._layers)
            if not self._decode_layers_fused:
                reason = "a projection's weight layout (oneDNN-packed)"
            else:
                # Each layer's decode_layer arguments but the step's tensors; a MoE layer's op
                # is only its attention half, so such models step layer by layer.
                stack_args = [
                    (*layer.fused_decode_call[1], *layer.fused_decode_call[2])
                    if isinstance(layer.mlp, MLP) else None
                    for layer in self._layers
                ]  # fmt: skip
                self._decode_stack = decode_stack(stack_args, self._layer_tables)
                self._decode_layers_op = torch.ops.genserve.decode_layers.default
        if reason is not None:
            log.info("fused_decode_layer_unused", reason=reason)

    @property
    def decode_layers_fused(self) -> bool:
        """True when decode-only CPU steps run each layer as one ``genserve::decode_layer``
        call (``use_fused_cpu_ops`` found the spec and the weights supported, no LoRA)."""
        return self._decode_layers_fused

    def use_fused_gpu_ops(self, max_positions: int) -> None:
        """Run every layer through the fused GPU ops (``kernels/fused_gpu_ops.py``: residual
        add + RMSNorm, rotary + paged K/V store, gated activation; one Triton launch each)
        wherever the layer's parts are ones they implement (RMSNorms, SiLU / GELU-tanh gated
        MLPs, any rotary), the eager ops elsewhere.  ``max_positions``: the longest context
        a request may reach; rotary tables are computed now for every position below it.
        Call once, on CUDA with Triton (the runner does), or on any device to run the ops'
        torch references (the CPU proof tests)."""
        if self.config.mla is not None:
            # The fused rotary + K/V store writes K/V heads; the latent rows are stored by
            # model/mla.py itself, so latent-attention models stay on the eager ops.
            log.info("fused_gpu_layers_unused", reason="multi-head latent attention")
            return
        torch_loop = {reason for layer in self._layers if (reason := layer.use_fused_gpu_ops())}
        if torch_loop:
            log.info("triton_moe_unused", reasons=sorted(torch_loop))
        self.norm.gpu_fused = isinstance(self.norm, RMSNorm)
        with torch.inference_mode():
            self._gpu_tables = [r.half_table(max_positions, self.dtype) for r in self._rotaries]
        self._gpu_fused = True
        log.info(
            "fused_gpu_layers",
            rotary_tables=[t is not None for t in self._gpu_tables],
            max_positions=max_positions,
        )

    def _pack_streamed_weights(self) -> None:
        """Pack every matrix in column panels and copy what a decode step streams into one
        region of 2 MiB pages (``model/huge_pages.py``; none where THP is not in madvise
        mode), matrix by matrix: each is packed, its stored form freed and handed back to
        the OS, then the packed copy placed, so loading holds about one copy of the weights
        plus one matrix (packing them all first and moving them after held two at the end:
        a GGUF load peaked at ~4x its file).  A tied embedding follows its head."""
        holders: list[_Packable] = [
            linear for layer in self._layers for linear in self._linears(layer)
        ]
        holders.append(self.lm_head)
        # A mixture-of-experts layer's routed experts are streamed too (the chosen ones'
        # rows every step), in the layout they are served in by now (moe.py's `fused`).
        moe_blocks = [layer.mlp for layer in self._layers if isinstance(layer.mlp, SparseMoeBlock)]
        # (a megabyte each over their size: each tensor starts on a cache line)
        sizes = [
            _packed_bytes_bound(holders),
            *(moe.streamed_bytes() + (1 << 20) for moe in moe_blocks),
        ]
        embed, head = self.embed_tokens, self.lm_head
        tied = self.config.tie_word_embeddings
        with (
            torch.inference_mode(),
            huge_page_region(sizes, head.weight.device) as region,
        ):
            for holder in holders:
                if holder is head and tied:
                    head.use_tied_panels(embed)  # drops the embedding's stored form too
                else:
                    holder.use_panels()
                if region is None:
                    continue
                release_freed_heap()  # the stored form's pages, before the copy takes new ones
                shared = [
                    attr
                    for attr in ("weight", "panels", "qpanels")
                    if holder is head
                    and getattr(head, attr) is not None
                    and getattr(embed, attr) is getattr(head, attr)
                ]
                holder.move_streamed_weights(region)
                for attr in shared:
                    setattr(embed, attr, getattr(head, attr))
            for moe in moe_blocks:
                if region is None:
                    break
                release_freed_heap()
                moe.move_streamed_experts(region)

    @property
    def rotary_needs_lengths(self) -> bool:
        """Whether a token's rotation depends on its sequence's length as well as its
        position (longrope, dynamic NTK): a prompt token then rotates by the prompt's length,
        which a decode row does not carry."""
        return self._needs_lengths

    def use_gpu_gemv(self) -> list[dict[str, object]]:
        """Steps of 1-4 rows run each projection whose Triton tile beat cuBLAS, timed on this
        GPU now (``model/gpu_gemv_plan``); returns the plan's records.  Call on CUDA once the
        weights are final, before CUDA graphs are captured."""
        from genserve.model import gpu_gemv_plan

        projections = [linear for layer in self._layers for linear in self._linears(layer)]
        return gpu_gemv_plan.plan(projections, self.lm_head)

    @staticmethod
    def _linears(layer: DecoderLayer) -> tuple[_Packable, ...]:
        """The layer's projections: attention's and its MLP's (a MoE layer's: its shared
        expert's; the routed experts are ``moe.SparseMoeBlock``'s own)."""
        return *layer.self_attn.linears(), *layer.mlp.linears()

    def enable_lora(self, step: StepAdapters) -> dict[str, tuple[LoraHook, ModuleSplit]]:
        """Attach a LoRA hook to every adaptable projection; returns, per PEFT module path
        (``model.layers.{i}.self_attn.q_proj``), the hook and how this rank slices it."""
        blocker = self.config.lora_blocker
        if blocker is not None:  # adapters are refused before they get here (read_adapter)
            raise UnsupportedModelError(f"LoRA adapters are not supported: {blocker}")
        targets: dict[str, tuple[LoraHook, ModuleSplit]] = {}
        self._decode_layers_fused = False  # the fused layer op has no LoRA deltas
        self._decode_stack = None
        for i, layer in enumerate(self._layers):
            attn, mlp = layer.self_attn, layer.mlp
            # lora_blocker refuses MoE and latent-attention models
            assert isinstance(mlp, MLP) and isinstance(attn, Attention)
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
        n = self.config.names
        self.embed_tokens.load(weights, f"{n.embed}.weight")
        for i, layer in enumerate(self._layers):
            layer.load(weights, n.layer.format(i=i))
        self.norm.load(weights, f"{n.final_norm}.weight")
        if not self.config.tie_word_embeddings:
            self.lm_head.load(weights, f"{n.lm_head}.weight")
        if self.lm_head_bias is not None:
            self.lm_head_bias.copy_(weights.get(f"{n.lm_head}.bias"))


def _packed_bytes_bound(holders: list[_Packable]) -> int:
    """An upper bound of the bytes ``holders``' streamed weights take once packed: twice
    their stored size plus a megabyte each (panels pad rows to 32 columns, the integer
    kernels' layout repeats a per-channel scale per block of 32).  Only the pages used are
    ever committed, and a matrix that would not fit stays on small pages."""
    total = 0
    for holder in holders:
        stored = holder.quant.nbytes if holder.quant is not None else holder.weight.nbytes
        total += 2 * stored + (1 << 20)
    return total
