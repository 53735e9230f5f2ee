"""The fused decoder-layer ops of the CUDA path, as torch custom ops (``genserve_gpu::*``):
residual add + RMSNorm, rotary + paged KV store, gated activation (issue #29).

Each op is one Triton launch where Triton runs (CUDA with Triton >= 3.0, or any device
under ``TRITON_INTERPRET=1``: ``triton_attention.available``), and its torch reference
elsewhere: the reference *is* the contract, written with the eager model's ops in the eager
model's order, and the Triton tests compare the kernels against it.  Being custom ops, each is
one op to the dispatcher — which is how the CPU proof test (``SyncAudit``) counts it as one
kernel launch, how ``torch.compile`` sees it (a fake implementation gives shapes), and why a
CUDA graph captures it as the one launch it is.

Where the kernel runs and nothing is being compiled, the public functions launch it
directly instead of through the custom op: the op's dispatch into Python cost 15-20 µs a
call on a 2.6 GHz Xeon (session 18: 28-35 µs against 14-16 µs for the same body called
directly), four or more calls a layer, on the host of every eager step (prompt and mixed
steps, LoRA steps), which on a GPU is host-bound.  A graph captures the same launch either
way; the CPU proof test, with no Triton running, still sees one custom op per call.

The model (``model/norms.py``, ``model/decoder.py``) calls these only on its fused GPU path
(``DecoderForCausalLM.use_fused_gpu_ops``); the eager torch path stays the reference used
everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from genserve.kernels import triton_attention, triton_gated_act, triton_norm, triton_rotary_kv

HEADS_FIRST = triton_rotary_kv.HEADS_FIRST
BLOCKS_FIRST = triton_rotary_kv.BLOCKS_FIRST
ACTIVATIONS = triton_gated_act.ACTIVATIONS


def triton_runs(device: torch.device) -> bool:
    """Whether these ops launch their Triton kernels for tensors on ``device``."""
    return triton_attention.available(device)


def _direct(x: torch.Tensor) -> bool:
    """Launch the kernel from here rather than through the custom op (module docstring)."""
    return triton_runs(x.device) and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[rows, hidden]`` times ``weight`` (see ``kernels/triton_norm``)."""
    if _direct(x):
        return triton_norm.rms_norm(x, weight, eps)[0]
    out: torch.Tensor = rms_norm_op(x, weight, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, rms_norm(x + residual) * weight)`` in one launch."""
    if _direct(x):
        normed, summed = triton_norm.rms_norm(x, weight, eps, residual)
        assert summed is not None
        return summed, normed
    pair: tuple[torch.Tensor, torch.Tensor] = add_rms_norm_op(x, residual, weight, eps)
    return pair


def gated_act(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of the merged ``[rows, 2 n]`` projection (``activation`` in
    :data:`ACTIVATIONS`)."""
    if _direct(gate_up):
        return triton_gated_act.gated_act(gate_up, activation)
    out: torch.Tensor = gated_act_op(gate_up, activation)
    return out


def rotary_store_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: int,
) -> None:
    """Rotate Q and K heads of ``qk`` in place and store K and ``v`` into the paged cache
    (see ``kernels/triton_rotary_kv``)."""
    if _direct(qk):
        triton_rotary_kv.rotary_store_kv(qk, v, cos, sin, positions, slots, kv_cache, layout)
    else:
        rotary_store_kv_op(qk, v, cos, sin, positions, slots, kv_cache, layout)


# ------------------------------------------------------------------------------ references
def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model/norms.RMSNorm``'s eager ``forward`` / ``add_forward``, op for op."""
    summed = x if residual is None else residual + x
    normed = F.rms_norm(summed.float(), (summed.shape[-1],), eps=eps)
    return weight * normed.to(summed.dtype), None if residual is None else summed


def gated_act_reference(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``model/decoder.MLP``'s eager gated activation, op for op."""
    n = gate_up.shape[1] // 2
    gate, up = gate_up[:, :n], gate_up[:, n:]
    if activation == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


def rotary_store_kv_reference(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: int,
) -> None:
    """``model/rotary.apply_rotary`` over Q and K, then the attention metadata's
    ``write_kv`` (two ``index_copy_``), op for op."""
    num_qk = qk.shape[1]
    num_kv_heads = v.shape[1]
    if cos is not None and sin is not None:
        if positions is not None:
            cos, sin = cos.index_select(0, positions), sin.index_select(0, positions)
        full_cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [tokens, 1, head_dim]
        signed_sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
        swapped = qk.view(*qk.shape[:-1], 2, -1).flip(-2).view(qk.shape)
        qk.copy_((qk * full_cos) + (swapped * signed_sin))
    k = qk[:, num_qk - num_kv_heads :]
    if layout == HEADS_FIRST:
        two, heads, num_blocks, block_size, head_dim = kv_cache.shape
        flat = kv_cache.view(two, heads, num_blocks * block_size, head_dim)
        flat[0].index_copy_(1, slots, k.transpose(0, 1))
        flat[1].index_copy_(1, slots, v.transpose(0, 1))
    else:
        two, num_blocks, block_size, heads, head_dim = kv_cache.shape
        flat = kv_cache.view(two, num_blocks * block_size, heads, head_dim)
        flat[0].index_copy_(0, slots, k)
        flat[1].index_copy_(0, slots, v)


# ------------------------------------------------------------------------------ custom ops
@torch.library.custom_op("genserve_gpu::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[rows, hidden]`` times ``weight`` (see ``kernels/triton_norm``)."""
    if triton_runs(x.device):
        return triton_norm.rms_norm(x, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)[0]


@rms_norm_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("genserve_gpu::add_rms_norm", mutates_args=())
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, rms_norm(x + residual) * weight)`` in one launch."""
    if triton_runs(x.device):
        normed, summed = triton_norm.rms_norm(x, weight, eps, residual)
    else:
        normed, summed = rms_norm_reference(x, weight, eps, residual)
    assert summed is not None
    return summed, normed


@add_rms_norm_op.register_fake
def _(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, torch.empty_like(out)


@torch.library.custom_op("genserve_gpu::gated_act", mutates_args=())
def gated_act_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` of the merged ``[rows, 2 n]`` projection (``activation`` in
    :data:`ACTIVATIONS`)."""
    if triton_runs(gate_up.device):
        return triton_gated_act.gated_act(gate_up, activation)
    return gated_act_reference(gate_up, activation)


@gated_act_op.register_fake
def _(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    rows, width = gate_up.shape
    return torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)


@torch.library.custom_op("genserve_gpu::rotary_store_kv", mutates_args=("qk", "kv_cache"))
def rotary_store_kv_op(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: int,
) -> None:
    """Rotate Q and K heads of ``qk`` in place and store K and ``v`` into the paged cache
    (see ``kernels/triton_rotary_kv``)."""
    if triton_runs(qk.device):
        triton_rotary_kv.rotary_store_kv(qk, v, cos, sin, positions, slots, kv_cache, layout)
    else:
        rotary_store_kv_reference(qk, v, cos, sin, positions, slots, kv_cache, layout)


@rotary_store_kv_op.register_fake
def _(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    positions: torch.Tensor | None,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    layout: int,
) -> None:
    return None
