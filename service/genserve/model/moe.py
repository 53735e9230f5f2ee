"""Mixture-of-experts MLPs: routing (:func:`route`) and expert execution
(:class:`SparseMoeBlock`), as a :class:`~genserve.model.spec.MoeSpec` describes them.

A token's router logits (float32, from a replicated ``[E, H]`` matrix, plus a bias where
the family has one) pick its top-k experts as the family's
:class:`~genserve.model.spec.RouterSpec` says; the chosen experts' SiLU-gated MLPs (gpt-oss:
clamped SwiGLU with biases, :class:`~genserve.model.spec.ClampedSwiGLU`) run and their
outputs are summed with the routing weights, plus the shared expert where the family has
one.  On CPU with genserve's kernels the routed part is one op
per layer (``kernels/moe_cpu.cpp``: rows grouped by expert, only the chosen experts' weights
read); on CUDA with Triton (``use_fused_gpu_ops``) two grouped-GEMM launches over the pairs
sorted by expert (``kernels/triton_moe.py``); elsewhere a loop over the chosen experts in
torch, as transformers computes it (the reference both are tested against).

Tensor parallelism splits every expert's width (its gate/up rows and down columns) between
the shards, as the dense MLP is split: each shard computes a partial sum for every token and
one all-reduce joins them.  Routing runs on every shard on the same input, so they agree.
A down-projection bias is held by the first shard only (the others hold zeros), so the
all-reduce adds it once.

Expert parallelism (``ParallelContext.expert_parallel``, ``--expert-parallel``) gives each
shard whole experts instead: a contiguous range ``[start, stop)`` of the routed experts at
full width.  Every shard still routes the same (replicated) hidden states the same way,
computes only the (token, choice) pairs whose expert it holds — never reading another
shard's expert weights — and the same all-reduce sums the shards' contributions: with
replicated activations that sum is the whole token exchange (no all-to-all dispatch).  Each
expert's down bias then lives on the one shard that holds the expert.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from genserve.kernels import fused_gpu_ops, triton_moe
from genserve.model.huge_pages import HugePageRegion
from genserve.model.layers import _Packable
from genserve.model.moe_gguf import QuantizedExperts, experts_gguf_torch
from genserve.model.spec import ClampedSwiGLU, ModelConfig, MoeSpec, RouterSpec, Scoring
from genserve.model.weights import WeightSource
from genserve.parallel import ParallelContext


class SharedExpert(Protocol):
    """The dense MLP the decoder builds for a shared expert (``decoder.MLP``)."""

    fused: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def load(self, weights: WeightSource, prefix: str) -> None: ...

    def linears(self) -> tuple[_Packable, ...]: ...


def route(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[num_tokens, E]`` (float32) → ``(weights, expert_ids)``, both
    ``[num_tokens, top_k]`` (float32, int64), computed in the order transformers' routers
    compute them so that ties and roundings agree."""
    if spec.scoring is Scoring.TOPK_SOFTMAX:
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    elif spec.scoring is Scoring.SOFTMAX:
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        scores = logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
        if spec.num_groups > 1:
            num_tokens = logits.shape[0]
            grouped = choice.view(num_tokens, spec.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [num_tokens, groups]
            best = torch.topk(group_scores, spec.topk_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores).scatter_(1, best, 1.0).bool()
            keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.scaling_factor != 1.0:
        weights = weights * spec.scaling_factor
    return weights, ids


# model/spec.py's Scoring as moe_route_cpu.cpp's ScoringCode (genserve_ops.h).
_SCORING_CODES = {Scoring.SOFTMAX: 0, Scoring.SIGMOID: 1, Scoring.TOPK_SOFTMAX: 2}


def routing_codes(spec: RouterSpec) -> list[int]:
    """``spec`` as ``genserve::moe_route``'s ``routing`` list (genserve_ops.h's RoutingValue
    order: scoring, top-k, renormalize, groups, top-k groups); ``scaling_factor`` and the
    biases go to the op as their own arguments."""
    return [
        _SCORING_CODES[spec.scoring],
        spec.top_k,
        int(spec.renormalize),
        spec.num_groups,
        spec.topk_groups,
    ]


def experts_torch(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    clamped: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The routed experts in torch: one pass per chosen expert over the rows that chose it
    (transformers' loop; the portable path and the kernel's reference).  ``x`` ``[T, H]``,
    ``ids``/``weights`` ``[T, K]``, ``w13`` ``[E, 2L, H]`` (gate rows, then up rows), ``w2``
    ``[E, H, L]``, optional biases ``b13`` ``[E, 2L]`` and ``b2`` ``[E, H]``, and the
    activation (SiLU-gated, or ``clamped``) → ``[T, H]`` in ``x``'s dtype."""
    out = torch.zeros_like(x)
    width = w13.shape[1] // 2
    for expert in torch.unique(ids).tolist():
        token_idx, k_pos = torch.where(ids == expert)
        bias13 = None if b13 is None else b13[expert]
        gate_up = F.linear(x[token_idx], w13[expert], bias13)  # [rows, 2L]
        gate, up = gate_up[:, :width], gate_up[:, width:]
        if clamped is None:
            act = F.silu(gate) * up
        else:
            gate = gate.clamp(max=clamped.limit)
            up = up.clamp(-clamped.limit, clamped.limit)
            act = (up + 1) * gate * torch.sigmoid(gate * clamped.alpha)
        y = F.linear(act, w2[expert], None if b2 is None else b2[expert])
        y = y * weights[token_idx, k_pos, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """A MoE layer's MLP: ``forward(x [num_tokens, hidden]) -> [num_tokens, hidden]``.

    ``shared`` is the shared expert (a dense MLP module built by the decoder, or None); its
    output joins the routed sum, scaled by ``sigmoid(x . shared_gate)`` where the spec has
    that gate."""

    def __init__(
        self,
        config: ModelConfig,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
        shared: SharedExpert | None,
    ) -> None:
        super().__init__()
        assert config.moe is not None
        spec: MoeSpec = config.moe
        self.spec = spec
        self.ctx = ctx
        hidden, num_experts = config.hidden_size, spec.router.num_experts
        if spec.router.top_k > num_experts:
            raise ValueError(f"top-{spec.router.top_k} of {num_experts} experts")
        if spec.router.num_groups > 1 and num_experts % spec.router.num_groups:
            raise ValueError(f"{num_experts} experts in {spec.router.num_groups} groups")
        # Routing runs in float32 on every shard (a replicated matrix; see the module doc).
        self.router = _param(torch.empty(num_experts, hidden, device=device))
        self.router_bias = (
            _param(torch.empty(num_experts, device=device)) if spec.router.bias else None
        )
        self.correction_bias = (
            _param(torch.empty(num_experts, device=device)) if spec.router.correction_bias else None
        )
        if spec.expert_bias and not spec.names.interleaved_gate_up:
            raise ValueError("expert biases are read from gpt-oss's stacked layout only")
        # This shard's routed experts [start, stop) and its slice of their width: whole
        # experts under expert parallelism, else every expert's 1/N of the width.
        if ctx.expert_parallel:
            self.expert_range = ctx.expert_share(num_experts)
            self.width_range = (0, spec.intermediate_size)
        else:
            self.expert_range = (0, num_experts)
            self.width_range = ctx.shard(spec.intermediate_size, "expert width")
        local = self.expert_range[1] - self.expert_range[0]
        width = self.width_range[1] - self.width_range[0]
        self.w13 = _param(torch.empty(local, 2 * width, hidden, dtype=dtype, device=device))
        self.w2 = _param(torch.empty(local, hidden, width, dtype=dtype, device=device))
        self.b13: nn.Parameter | None = None
        self.b2: nn.Parameter | None = None
        if spec.expert_bias:
            self.b13 = _param(torch.empty(local, 2 * width, dtype=dtype, device=device))
            self.b2 = _param(torch.empty(local, hidden, dtype=dtype, device=device))
        self.shared = shared
        self.shared_gate = (
            _param(torch.empty(1, hidden, dtype=dtype, device=device))
            if shared is not None and spec.shared_gate
            else None
        )
        self._fused = False
        # decode_args' cached answer; None until asked and whenever the experts change.
        self._decode_args: tuple[object, ...] | None = None
        # Set by use_fused_gpu_ops: the routed experts through kernels/triton_moe.py.
        self.gpu_fused = False
        # Set from a GGUF file's blocks (``set_quantized_experts``): replaces w13/w2.
        self.quantized_experts: QuantizedExperts | None = None

    @property
    def fused(self) -> bool:
        """Whether the routed experts run as ``genserve::moe_experts`` (CPU kernels loaded;
        set by ``DecoderForCausalLM.use_fused_cpu_ops``, as the dense MLP's flag is)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = value
        self._decode_args = None
        if self.shared is not None:
            self.shared.fused = value
        if self.quantized_experts is not None:  # the kernel path, as quantized linears pick it
            from genserve.kernels import int_dot
            from genserve.model.kquants import FLOAT_PATH

            choice = int_dot.choose() if value and int_dot.active() else None
            isa = FLOAT_PATH if choice is None or choice.isa is None else int(choice.isa)
            self.quantized_experts = self.quantized_experts.serving(isa)

    def streamed_bytes(self) -> int:
        """Bytes of the routed experts a CPU decode step streams from (the GGUF blocks, or
        ``w13``/``w2``): what :meth:`move_streamed_experts` places."""
        if self.quantized_experts is not None:
            return self.quantized_experts.nbytes
        return int(self.w13.nbytes + self.w2.nbytes)

    def move_streamed_experts(self, region: HugePageRegion) -> None:
        """Replace the routed experts' tensors by copies placed in ``region`` (2 MiB pages,
        ``model/huge_pages.py``), as the decoder does for its dense projections: a step
        reads 8-50 experts' rows, each a separate stream that in 4 KiB pages stops the
        prefetchers at every page (docs/models/moe.md has the measurements)."""
        self._decode_args = None
        if self.quantized_experts is not None:
            self.quantized_experts = self.quantized_experts.placed(region)
        elif self.w13.numel() > 0:
            self.w13 = _param(region.place(self.w13.detach()))
            self.w2 = _param(region.place(self.w2.detach()))

    def use_fused_gpu_ops(self) -> str | None:
        """Run the routed experts through the Triton kernels (``kernels/triton_moe.py``)
        where Triton runs for the step's device.  Returns why they stay on the torch loop
        instead (GGUF blocks: dequantized per step; a dtype the kernels do not take), or
        None.  The shared expert is the decoder's dense MLP: the decoder sets it."""
        if self.quantized_experts is not None:
            return "expert blocks from a GGUF file (dequantized per step)"
        reason = triton_moe.supports(self.w13[:0, 0], self.w13, self.w2)
        self.gpu_fused = reason is None
        return reason

    def set_quantized_experts(self, experts: QuantizedExperts) -> None:
        """Serve the routed experts from ``experts`` (a GGUF file's blocks, or the Q8_0 /
        Q4_0 blocks ``--quantize int8|int4`` makes: ``model/moe_quant.py``) and drop the
        float ``w13``/``w2`` (never written: they cost no memory until then).  gpt-oss's
        expert biases ``b13``/``b2`` stay float beside the blocks and, with its clamped
        SwiGLU, go to the op as its optional arguments."""
        # This shard's experts: every expert, or its range under expert parallelism (a GGUF
        # file's stacks hold every expert, so those are not set under expert parallelism).
        num_experts = self.expert_range[1] - self.expert_range[0]
        hidden = self.router.shape[1]
        width = self.width_range[1] - self.width_range[0]
        expected = ((num_experts, width), (num_experts, width), (num_experts, hidden))
        got = tuple(tuple(t.shape[:2]) for t in (experts.gate, experts.up, experts.down))
        if got != expected:
            raise ValueError(f"expert blocks of shapes {got}, expected {expected}")
        self.quantized_experts = experts
        self._decode_args = None
        self.w13 = _param(self.w13.new_empty(0, 0, 0))
        self.w2 = _param(self.w2.new_empty(0, 0, 0))
        if self._fused:  # already on the CPU kernels: the blocks take their kernel path now
            self.fused = True

    def linears(self) -> tuple[_Packable, ...]:
        """The projections the dense paths (panels, --quantize) handle: the shared
        expert's.  The routed experts stay in ``w13``/``w2`` in the model dtype, or in GGUF
        blocks (``quantized_experts``: a GGUF file's, or ``--quantize int8|int4``'s)."""
        return self.shared.linears() if self.shared is not None else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.router, self.router_bias)  # [num_tokens, E]
        weights, ids = route(logits, self.spec.router, self.correction_bias)
        if self.ctx.expert_parallel:
            out = self._own_experts(x, ids, weights)
        else:
            out = self._experts(x, ids, weights)
        # Each shard summed its slice of every expert's width, or (expert parallel) the
        # pairs of the experts it holds: either way the sum over shards is the routed output.
        out = self.ctx.all_reduce(out)
        if self.shared is not None:
            out = out + self.shared_output(x)
        return out

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert's part of the output, gated where the spec has its gate."""
        assert self.shared is not None
        shared = self.shared.forward(x)
        if self.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return shared

    def decode_args(self) -> tuple[object, ...] | None:
        """``genserve::decode_moe_layer``'s routing and expert arguments, ``router`` to
        ``add_routed`` (kernels/decode_layer_cpu.cpp: attention half, router and routed experts
        in one op, bit-identical to :meth:`forward`); None where that op does not run this
        block: CPU kernels off, or a sharded block (its routed sum is all-reduced between the
        experts and the shared expert).  Cached: asked every decode step."""
        if not self._fused or self.ctx.world_size > 1 or self.router.device.type != "cpu":
            return None
        if self._decode_args is None:
            clamped = self.spec.activation
            q = self.quantized_experts
            experts = [self.w13, self.w2] if q is None else [q.gate, q.up, q.down]
            self._decode_args = (
                self.router, self.router_bias, self.correction_bias,
                routing_codes(self.spec.router), self.spec.router.scaling_factor,
                experts, [] if q is None else q.codes, -1 if q is None else q.isa,
                self.b13, self.b2,
                0.0 if clamped is None else clamped.alpha,
                0.0 if clamped is None else clamped.limit,
                self.shared is None,
            )  # fmt: skip
        return self._decode_args

    def _experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed sum over ``ids`` ``[T, K]`` (indices into this shard's ``w13``/``w2``,
        or into the GGUF blocks of ``quantized_experts``, which hold every expert)."""
        clamped = self.spec.activation
        if self.quantized_experts is not None:  # the file's blocks (set_quantized_experts)
            how = (self.b13, self.b2, clamped)
            if self._fused and x.device.type == "cpu":
                return self.quantized_experts.forward(x, ids, weights, *how)
            return experts_gguf_torch(x, ids, weights, self.quantized_experts, *how)
        if self._fused and x.device.type == "cpu":
            out: torch.Tensor = torch.ops.genserve.moe_experts(
                x, ids, weights, self.w13, self.w2, self.b13, self.b2,
                0.0 if clamped is None else clamped.alpha,
                0.0 if clamped is None else clamped.limit,
            )  # fmt: skip
            return out
        if self.gpu_fused and fused_gpu_ops.triton_runs(x.device):
            clamp = None if clamped is None else (clamped.alpha, clamped.limit)
            return triton_moe.fused_experts(
                x, ids, weights, self.w13, self.w2, self.b13, self.b2, clamp
            )
        return experts_torch(x, ids, weights, self.w13, self.w2, self.b13, self.b2, clamped)

    def _own_experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Expert parallelism: this shard's part of the routed sum, from the (token, choice)
        pairs whose expert it holds only.  The pairs go to the expert op as rows of one
        choice each (a token choosing two of this shard's experts is two rows), so the op
        groups them by expert as usual and reads only this shard's weights."""
        start, stop = self.expert_range
        token_idx, k_pos = torch.nonzero((ids >= start) & (ids < stop), as_tuple=True)
        if token_idx.numel() == 0:  # none of this step's choices is ours
            return torch.zeros_like(x)
        local_ids = (ids[token_idx, k_pos] - start).unsqueeze(1)  # [pairs, 1]
        pairs = self._experts(x[token_idx], local_ids, weights[token_idx, k_pos].unsqueeze(1))
        # A token's choices summed in float32 and rounded once, as the op does within a row
        # (in bfloat16 a per-choice sum would round once per choice).
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, token_idx, pairs.float()).to(x.dtype)

    @torch.no_grad()
    def load(self, weights: WeightSource, prefix: str) -> None:
        """This shard's experts (all, or its range under expert parallelism) and its slice
        of their width, from per-expert matrices or stacked ones."""
        n = self.spec.names
        self.router.copy_(weights.get(f"{prefix}.{n.router}.weight"))
        if self.router_bias is not None:
            self.router_bias.copy_(weights.get(f"{prefix}.{n.router}.bias"))
        if self.correction_bias is not None:
            self.correction_bias.copy_(weights.get(f"{prefix}.{n.correction_bias}"))
        start, stop = self.width_range
        first, last = self.expert_range
        full = self.spec.intermediate_size
        width = stop - start
        experts = f"{prefix}.{n.experts}"
        if self.quantized_experts is not None:  # kept as the GGUF file's blocks
            pass
        elif weights.has(f"{experts}.gate_up_proj_blocks"):  # gpt-oss's released MXFP4
            self._load_mxfp4(weights, experts)
        elif n.interleaved_gate_up and not weights.has(f"{experts}.gate_proj"):
            self._load_interleaved(weights, experts)
        elif weights.has(f"{experts}.gate_proj"):  # GGUF stacks: [E, I, H] twice, [E, H, I]
            gate, up, down = (
                weights.get_slice(f"{experts}.{p}_proj", 0, first, last)  # this shard's experts
                for p in ("gate", "up", "down")
            )
            self.w13[:, :width].copy_(gate[:, start:stop])
            self.w13[:, width:].copy_(up[:, start:stop])
            self.w2.copy_(down[:, :, start:stop])
        elif weights.has(f"{experts}.gate_up_proj") and self.ctx.expert_parallel:
            # Whole experts: this shard's rows of the stacks [E, 2I, H] and [E, H, I].
            self.w13.copy_(weights.get_slice(f"{experts}.gate_up_proj", 0, first, last))
            self.w2.copy_(weights.get_slice(f"{experts}.down_proj", 0, first, last))
        elif weights.has(f"{experts}.gate_up_proj"):  # [E, 2I, H] and [E, H, I]
            stacked = f"{experts}.gate_up_proj"
            self.w13[:, :width].copy_(weights.get_slice(stacked, 1, start, stop))
            self.w13[:, width:].copy_(weights.get_slice(stacked, 1, full + start, full + stop))
            self.w2.copy_(weights.get_slice(f"{experts}.down_proj", 2, start, stop))
        else:
            rows = weights.get_slice
            for e in range(first, last):
                at, mine = f"{experts}.{e}", e - first
                self.w13[mine, :width].copy_(rows(f"{at}.{n.gate}.weight", 0, start, stop))
                self.w13[mine, width:].copy_(rows(f"{at}.{n.up}.weight", 0, start, stop))
                self.w2[mine].copy_(rows(f"{at}.{n.down}.weight", 1, start, stop))
        if self.b13 is not None and weights.has(f"{experts}.gate_proj_bias"):
            self._load_split_biases(weights, experts)
        elif self.b13 is not None and weights.has(f"{experts}.gate_up_proj_bias"):
            self._load_interleaved_biases(weights, experts)
        if self.shared is not None:
            self.shared.load(weights, prefix)
        if self.shared_gate is not None:
            self.shared_gate.copy_(weights.get(f"{prefix}.{n.shared_gate}.weight"))

    def _load_split_biases(self, weights: WeightSource, experts: str) -> None:
        """gpt-oss's expert biases from a GGUF file, split as its converter splits the
        interleaved ``gate_up_proj_bias``: ``gate_proj_bias``/``up_proj_bias`` ``[E, I]``
        and ``down_proj_bias`` ``[E, H]``."""
        assert self.b13 is not None and self.b2 is not None
        start, stop = self.width_range
        first, last = self.expert_range
        width = stop - start
        self.b13[:, :width].copy_(weights.get(f"{experts}.gate_proj_bias")[first:last, start:stop])
        self.b13[:, width:].copy_(weights.get(f"{experts}.up_proj_bias")[first:last, start:stop])
        self.b2.copy_(weights.get(f"{experts}.down_proj_bias")[first:last])
        if self.ctx.rank != 0 and not self.ctx.expert_parallel:  # see _load_interleaved_biases
            self.b2.zero_()

    def _load_interleaved(self, weights: WeightSource, experts: str) -> None:
        """gpt-oss's layout (``MoeNames.interleaved_gate_up``): this shard's gate columns
        ``2j`` and up columns ``2j + 1`` of ``[E, H, 2I]``, transposed into ``w13``'s rows."""
        start, stop = self.width_range
        first, last = self.expert_range
        width = stop - start
        gate_cols = torch.arange(start, stop) * 2
        for e in range(first, last):
            # One expert at a time: the transposed copy of a whole layer would double it.
            gate_up = weights.get_slice(f"{experts}.gate_up_proj", 0, e, e + 1)[0]  # [H, 2I]
            self.w13[e - first, :width].copy_(gate_up[:, gate_cols].t())
            self.w13[e - first, width:].copy_(gate_up[:, gate_cols + 1].t())
            down = weights.get_slice(f"{experts}.down_proj", 0, e, e + 1)[0]  # [I, H]
            self.w2[e - first].copy_(down[start:stop].t())

    def _load_mxfp4(self, weights: WeightSource, experts: str) -> None:
        """gpt-oss's released checkpoints: the experts' MXFP4 blocks and scales rearranged
        into GGML MXFP4 stacks (``model/mxfp4.py``, lossless) and served by the quantized
        expert op, or — where this shard holds a slice of the expert width, which would cut
        the down projection's blocks — dequantized into ``w13``/``w2``."""
        from genserve.model.moe_gguf import dequantize_expert
        from genserve.model.mxfp4 import MXFP4, expert_stacks

        parts = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                 "down_proj_scales")  # fmt: skip
        gate, up, down = expert_stacks(*(weights.get(f"{experts}.{p}") for p in parts))
        start, stop = self.width_range
        first, last = self.expert_range
        if (start, stop) == (0, self.spec.intermediate_size):
            mine = slice(first, last)
            stacks = (gate[mine].contiguous(), up[mine].contiguous(), down[mine].contiguous())
            self.set_quantized_experts(QuantizedExperts(*stacks, (MXFP4,) * 3))
            return
        width = stop - start
        for e in range(first, last):
            self.w13[e - first, :width].copy_(dequantize_expert(gate, MXFP4, e)[start:stop])
            self.w13[e - first, width:].copy_(dequantize_expert(up, MXFP4, e)[start:stop])
            self.w2[e - first].copy_(dequantize_expert(down, MXFP4, e)[:, start:stop])

    def _load_interleaved_biases(self, weights: WeightSource, experts: str) -> None:
        """gpt-oss's ``gate_up_proj_bias`` (gate ``2j``, up ``2j + 1``) and ``down_proj_bias``."""
        start, stop = self.width_range
        first, last = self.expert_range
        width = stop - start
        gate_cols = torch.arange(start, stop) * 2
        if self.b13 is not None and self.b2 is not None:
            bias = weights.get(f"{experts}.gate_up_proj_bias")[first:last]  # [E, 2I]
            self.b13[:, :width].copy_(bias[:, gate_cols])
            self.b13[:, width:].copy_(bias[:, gate_cols + 1])
            self.b2.copy_(weights.get(f"{experts}.down_proj_bias")[first:last])
            # Summed over the shards by the all-reduce: under tensor parallelism every shard
            # computes every chosen expert, so the first shard alone holds the bias; under
            # expert parallelism each expert's pairs are computed once, by its holder.
            if self.ctx.rank != 0 and not self.ctx.expert_parallel:
                self.b2.zero_()


def _param(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)
