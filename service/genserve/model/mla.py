"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of latents.

The cache holds, per token and layer, what ``kv_a_proj_with_mqa`` produces: the RMS-normed
latent (``kv_lora_rank`` values) and the rotated rope key (``qk_rope_head_dim``), one row of
:attr:`~genserve.model.spec.MlaSpec.cache_width` values shared by every head — not each
head's expanded key and value.  The layer's cache tensor is ``[1, 1, num_blocks, block_size,
cache_width]`` (:func:`latent_cache_shape`): the torch backend's ``[planes, heads, blocks,
block_size, width]`` layout with one plane and one head, so blocks, slots and block tables
mean what they mean for every other model, and prefix caching shares latent blocks as it
shares K/V blocks.

Attention reads the latents two ways, as vLLM and SGLang do:

- **Prefill chunks expand**: the chunk's context latents (fresh ones, or read through the
  block table after a prefix-cache hit or an earlier chunk) go through ``kv_b_proj`` into
  per-head keys (``[nope | rope]``) and values, and attention is transformers' computation.
- **Decodes absorb** ``kv_b_proj`` into the query and the output: with ``W_UK`` / ``W_UV``
  the key / value rows of a head, ``q_nope · (W_UK c) = (W_UKᵀ q_nope) · c``, so each head's
  query becomes a ``kv_lora_rank + rope`` vector scored against the cached rows directly (one
  shared "key head": multi-query attention), and the weighted sum of latents is mapped to the
  head's value by ``W_UV`` once.  A decode step then reads ``cache_width`` values per context
  token instead of expanding the whole context through ``kv_b_proj`` every step (which costs
  ``context * heads * (nope + v) * kv_lora_rank`` multiply-adds per layer per step).  It is
  the same arithmetic in another order: float32 results agree with the expansion to ~1e-6.

Tensor parallelism splits the heads (``q_b_proj``/``q_proj`` rows, ``kv_b_proj`` rows,
``o_proj`` columns, one all-reduce); the latent projections are replicated, so every shard
computes and caches the same latents.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from genserve.model.attention import AttentionMetadata, TorchAttentionMetadata
from genserve.model.layers import ColumnParallelLinear, RowParallelLinear, _Packable
from genserve.model.norms import Norm, RMSNorm
from genserve.model.rotary import apply_rotary, head_permutation
from genserve.model.spec import MlaSpec, ModelConfig, UnsupportedModelError
from genserve.model.weight_views import RowView, RowViews, head_rows
from genserve.model.weights import WeightSource
from genserve.parallel import ParallelContext


def latent_cache_shape(num_blocks: int, block_size: int, width: int) -> tuple[int, ...]:
    """One layer's latent cache: ``[1, 1, num_blocks, block_size, width]`` (see the module
    docstring; blocks on dimension 2, as in ``TorchPagedAttention``'s layout)."""
    return (1, 1, num_blocks, block_size, width)


class LatentAttention(nn.Module):
    """One layer's latent attention (``spec.MlaSpec``); the decoder's ``Attention`` interface:
    ``forward(x, cos, sin, kv_cache, meta)`` with ``cos``/``sin`` over the rope width."""

    fused = False  # set by use_fused_cpu_ops; latent attention has no fused CPU op (unused)
    window: int | None = None  # no sliding window

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        ctx: ParallelContext,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        if config.mla is None:
            raise ValueError("LatentAttention needs a spec with mla")
        spec: MlaSpec = config.mla
        self.spec = spec
        self.config = config
        total_heads = config.num_heads
        if total_heads % ctx.world_size:
            raise UnsupportedModelError(
                f"latent attention splits its {total_heads} heads evenly between shards: "
                f"--num-shard {ctx.world_size} does not divide them"
            )
        start, stop = ctx.shard(total_heads, "attention heads")
        self.num_heads = stop - start
        self.num_kv_heads = 1  # the cache's one latent row per token
        self.scale = config.attention.scale or spec.qk_head_dim**-0.5
        hidden, qk, rank = config.hidden_size, spec.qk_head_dim, spec.kv_lora_rank
        replicated = ParallelContext.single()  # every shard computes the latents whole
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_norm: RMSNorm | None = None
        q_in = hidden
        if spec.q_lora_rank is not None:
            q_in = spec.q_lora_rank
            self.q_a_proj = ColumnParallelLinear(
                hidden, [q_in], spec.bias, replicated, dtype, device
            )
            self.q_a_norm = RMSNorm(q_in, spec.norm_eps, dtype, device)
        # q_b_proj (or q_proj): this shard's heads, [nope | rope] features each.
        self.q_proj = ColumnParallelLinear(q_in, [total_heads * qk], False, ctx, dtype, device)
        self.kv_a_proj = ColumnParallelLinear(
            hidden, [spec.cache_width], spec.bias, replicated, dtype, device
        )
        self.kv_a_norm = RMSNorm(rank, spec.norm_eps, dtype, device)
        # kv_b_proj, this shard's heads: [heads * (nope + v), kv_lora_rank].  A plain tensor
        # (never packed or quantized): decodes read it as per-head matrices (absorption).
        kv_b_rows = self.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
        self.kv_b = nn.Parameter(
            torch.empty(kv_b_rows, rank, dtype=dtype, device=device), requires_grad=False
        )
        self._kv_b_rows = (
            start * (spec.qk_nope_head_dim + spec.v_head_dim),
            stop * (spec.qk_nope_head_dim + spec.v_head_dim),
        )
        v = spec.v_head_dim
        self.o_proj = RowParallelLinear(
            total_heads * v, hidden, spec.bias, ctx, dtype, device, in_range=(start * v, stop * v)
        )
        # De-interleaves DeepSeek's rope pairs into halves (rotary.head_permutation).
        rope = spec.qk_rope_head_dim
        self.rope_perm = head_permutation(rope, rope, spec.interleaved_rope)

    def linears(self) -> tuple[_Packable, ...]:
        """The projections the CPU paths pack / quantize (``kv_b`` stays plain)."""
        q = (self.q_proj,) if self.q_a_proj is None else (self.q_a_proj, self.q_proj)
        return (*q, self.kv_a_proj, self.o_proj)

    def norms(self) -> list[Norm]:
        return [n for n in (self.q_a_norm, self.kv_a_norm) if n is not None]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, heads, nope + rope]`` (rope features not yet rotated)."""
        if self.q_a_proj is not None and self.q_a_norm is not None:
            x = self.q_a_norm.forward(self.q_a_proj.forward(x))
        return self.q_proj.forward(x).view(x.shape[0], self.num_heads, self.spec.qk_head_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``x`` ``[num_tokens, hidden]`` → ``[num_tokens, hidden]``; stores each token's
        latent row in ``kv_cache`` (``[1, 1, num_blocks, block_size, cache_width]``)."""
        if not isinstance(meta, TorchAttentionMetadata):
            raise UnsupportedModelError("latent attention runs on the torch attention backend")
        spec = self.spec
        nope, rank, width = spec.qk_nope_head_dim, spec.kv_lora_rank, spec.cache_width
        num_tokens = x.shape[0]
        q = self._queries(x)
        latent_rope = self.kv_a_proj.forward(x)  # [num_tokens, rank + rope]
        latent = self.kv_a_norm.forward(latent_rope[:, :rank].contiguous())
        q_rope = apply_rotary(q[:, :, nope:], cos, sin)  # [num_tokens, heads, rope]
        k_rope = apply_rotary(latent_rope[:, None, rank:], cos, sin)  # [num_tokens, 1, rope]
        rows = torch.cat((latent, k_rope[:, 0]), dim=-1)  # [num_tokens, width]: cached rows
        cache = kv_cache.view(-1, width)  # [num_blocks * block_size, width]
        cache.index_copy_(0, meta.slots, rows)
        q_nope = q[:, :, :nope]
        out = torch.empty(
            num_tokens, self.num_heads * spec.v_head_dim, dtype=x.dtype, device=x.device
        )
        d = meta.num_decodes
        if d:
            out[:d] = self._decode(q_nope[:d], q_rope[:d], kv_cache, meta)
        for p in meta.prefills:
            s, n = p.token_start, p.num_tokens
            if p.start_pos == 0:  # the whole context is this chunk: its rows as computed
                context = rows[s : s + n]
            else:  # earlier positions come from the cache (prefix hit, earlier chunk)
                blocks = kv_cache[0, 0].index_select(0, p.block_ids)
                context = blocks.view(-1, width)[: p.start_pos + n]
            mask = p.mask(None, x.device)
            out[s : s + n] = self._expanded(q_nope[s : s + n], q_rope[s : s + n], context, mask)
        return self.o_proj.forward(out)

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        context: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """A prefill chunk of ``n`` tokens against ``context`` rows ``[ctx_len, width]``,
        the latents expanded into keys and values (transformers' computation) →
        ``[n, heads * v]``.  ``mask`` ``[n, ctx_len]`` bool, None: causal from position 0."""
        spec, h = self.spec, self.num_heads
        nope, rank, rope = spec.qk_nope_head_dim, spec.kv_lora_rank, spec.qk_rope_head_dim
        n, ctx_len = q_nope.shape[0], context.shape[0]
        kv = F.linear(context[:, :rank], self.kv_b).view(ctx_len, h, nope + spec.v_head_dim)
        k_rope = context[:, None, rank:].expand(ctx_len, h, rope)
        keys = torch.cat((kv[..., :nope], k_rope), dim=-1)  # [ctx_len, h, nope + rope]
        values = kv[..., nope:]  # [ctx_len, h, v]
        q = torch.cat((q_nope, q_rope), dim=-1)  # [n, h, nope + rope]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )  # [1, h, n, v]
        return o[0].transpose(0, 1).reshape(n, h * spec.v_head_dim)

    def _decode(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: TorchAttentionMetadata,
    ) -> torch.Tensor:
        """Every decode row at once, ``kv_b_proj`` absorbed (module docstring) →
        ``[num_decodes, heads * v]``."""
        spec, h = self.spec, self.num_heads
        nope, rank, width = spec.qk_nope_head_dim, spec.kv_lora_rank, spec.cache_width
        d = q_nope.shape[0]
        block_size = kv_cache.shape[3]
        w = self.kv_b.view(h, nope + spec.v_head_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]  # [h, nope, rank], [h, v, rank]
        # Per head: q_nope [d, nope] @ W_UK [nope, rank] → the query in latent space.
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [d, h, rank]
        q = torch.cat((q_latent, q_rope), dim=-1)  # [d, h, width]
        # Each decode's blocks: [d, 1, max_blocks * block_size, width]; its heads are the
        # query length of one multi-query attention (one shared latent "head").
        context = kv_cache[0, 0].index_select(0, meta.decode_blocks)
        context = context.view(d, 1, meta.decode_max_blocks * block_size, width)
        mask = meta.decode_mask(None, block_size, q.dtype).transpose(0, 1)  # [d, 1, 1, L]
        o = F.scaled_dot_product_attention(
            q[:, None], context, context[..., :rank], attn_mask=mask, scale=self.scale
        )  # [d, 1, h, rank]: each head's weighted sum of latents
        out = torch.bmm(o[:, 0].transpose(0, 1), w_uv.transpose(1, 2))  # [h, d, v]
        return out.transpose(0, 1).reshape(d, h * spec.v_head_dim)

    def load(self, weights: WeightSource, prefix: str) -> None:
        spec, names = self.spec, self.spec.names
        nope, rope, rank = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
        perm = self.rope_perm or list(range(rope))
        # Queries: each head's rope rows de-interleaved; latent rope rows likewise.
        head_perm = list(range(nope)) + [nope + i for i in perm]
        q_rows = head_rows(self.config.num_heads, spec.qk_head_dim, head_perm)
        kv_a_rows = torch.cat((torch.arange(rank), rank + torch.tensor(perm)))
        q_name = names.q if self.q_a_proj is None else names.q_b
        views = {
            "q.weight": RowView(f"{prefix}.{q_name}.weight", q_rows),
            "kv_a.weight": RowView(f"{prefix}.{names.kv_a}.weight", kv_a_rows),
            "kv_a.bias": RowView(f"{prefix}.{names.kv_a}.bias", kv_a_rows),
        }
        viewed = RowViews(weights, views)
        self.q_proj.load(viewed, ["q"])
        self.kv_a_proj.load(viewed, ["kv_a"])
        if self.q_a_proj is not None and self.q_a_norm is not None:
            self.q_a_proj.load(weights, [f"{prefix}.{names.q_a}"])
            self.q_a_norm.load(weights, f"{prefix}.{names.q_a_norm}.weight")
        self.kv_a_norm.load(weights, f"{prefix}.{names.kv_a_norm}.weight")
        start, stop = self._kv_b_rows
        kv_b = weights.get_slice(f"{prefix}.{names.kv_b}.weight", 0, start, stop)
        if tuple(kv_b.shape) != tuple(self.kv_b.shape):
            raise ValueError(
                f"{prefix}.{names.kv_b}.weight: checkpoint shape {tuple(kv_b.shape)} != "
                f"{tuple(self.kv_b.shape)}"
            )
        self.kv_b.copy_(kv_b)
        self.o_proj.load(weights, f"{prefix}.{self.config.names.o}")
