"""Rotary position embeddings: every scaling kind transformers implements for the dense
families (default, linear, dynamic, llama3, yarn, longrope), and partial / interleaved
rotation folded into the one "rotate half" kernel by a fixed permutation of head features.

Partial and interleaved rotary are served by the same rotation as full rotary:

* the q/k projection rows of each head are permuted once at load time
  (:func:`head_permutation`) so that the features that rotate together sit ``head_dim / 2``
  apart, as "rotate half" pairs them; attention scores ``q·k`` are unchanged by permuting both
  alike, and values are not permuted, so the layer's output is the same;
* features that do not rotate (partial rotary) get ``cos = 1, sin = 0``: ``x * 1 + y * 0``
  is ``x`` exactly.

So the CPU ``rotary`` / ``rotary_write_kv`` ops and the fused decode layer serve every kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from genserve.model import rope_scaling
from genserve.model.spec import RopeConfig, UnsupportedModelError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_inv_freq(rope: RopeConfig, dim: int, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[dim // 2]`` (float32) as transformers computes them for a
    rotary width ``dim``; ``long``: longrope's long-context set."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type in ("default", "dynamic"):  # dynamic: per step, see cos_sin
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"]
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, dict(rope.params))
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim)
    raise UnsupportedModelError(
        f"rope type {rope.rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)"
    )


def attention_factor(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by (yarn, longrope; else 1)."""
    given = rope.params.get("attention_factor")
    if given is not None:
        return float(given)
    if rope.rope_type == "yarn":
        factor = rope.params["factor"]
        mscale, mscale_all = rope.params.get("mscale"), rope.params.get("mscale_all_dim")
        if mscale and mscale_all:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        return _yarn_mscale(factor)
    if rope.rope_type == "longrope":
        factor = rope.params["factor"]
        original = rope.params["original_max_position_embeddings"]
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: extrapolated frequencies for the fast dimensions, interpolated (``/ factor``)
    for the slow ones, a linear ramp between (transformers' ``_compute_yarn_parameters``)."""
    p = rope.params
    base, factor = rope.theta, p["factor"]
    original = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32.0, p.get("beta_slow") or 1.0

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def head_permutation(head_dim: int, rotary_dim: int, interleaved: bool) -> list[int] | None:
    """``perm`` with ``new[j] = old[perm[j]]`` for each head's q/k features, making the
    rotation "rotate half" over the whole head (see the module docstring); None: identity."""
    if rotary_dim == head_dim and not interleaved:
        return None
    if interleaved:
        if rotary_dim != head_dim:
            raise UnsupportedModelError("interleaved partial rotary is not supported")
        return list(range(0, head_dim, 2)) + list(range(1, head_dim, 2))
    if rotary_dim % 2 or (head_dim - rotary_dim) % 2:
        raise UnsupportedModelError(f"rotary width {rotary_dim} of {head_dim} is not even")
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half)) + list(range(rotary_dim, rotary_dim + rest))
    second = list(range(half, rotary_dim)) + list(range(rotary_dim + rest, head_dim))
    return first + second


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, laid out for :func:`apply_rotary` over whole heads."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, device: torch.device, rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.rope, self.head_dim = rope, head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.inv_freq: torch.Tensor
        inv_freq = rope_inv_freq(rope, self.rotary_dim).to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.long_inv_freq: torch.Tensor | None = None
        if rope.rope_type == "longrope":
            self.long_inv_freq = rope_inv_freq(rope, self.rotary_dim, long=True).to(device)
        self.scaling = attention_factor(rope)

    @property
    def needs_lengths(self) -> bool:
        """Whether :meth:`cos_sin` depends on each token's sequence length."""
        return self.rope.rope_type == "dynamic" or self.long_inv_freq is not None

    def _freqs(self, positions: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """Angles ``[num_tokens, rotary_dim // 2]``."""
        if self.rope.rope_type == "dynamic":  # issue #15 --rope-scaling dynamic
            return rope_scaling.dynamic_freqs(positions, self.rope, self.rotary_dim, lengths)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            # transformers switches to the long factors once the sequence is longer than the
            # original context; per sequence here, as a request computed alone would.
            original = self.rope.params["original_max_position_embeddings"]
            if lengths is None:
                lengths = rope_scaling.sequence_lengths(positions)
            long = lengths > original
            # Both sets, chosen per token on the device: asking whether any token is long
            # (``bool(long.any())``) is a value read that CUDA graph capture cannot take.
            long_freqs = positions[:, None].float() * self.long_inv_freq[None, :]
            freqs = torch.where(long[:, None], long_freqs, freqs)
        return freqs

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and *signed* ``sin`` of shape ``[num_tokens, 1, head_dim]``, computed once
        per step and shared by every layer.  The first half of ``sin`` is negated so that
        :func:`apply_rotary` needs a flip instead of transformers' ``cat(-x2, x1)``.
        ``lengths``: each token's sequence length (see :attr:`needs_lengths`; default: read
        from the runs of consecutive positions)."""
        freqs = self._freqs(positions, lengths)  # [num_tokens, rotary_dim / 2]
        pad = (self.head_dim - self.rotary_dim) // 2
        if pad:  # features that do not rotate: cos 1, sin 0 (see head_permutation)
            freqs = torch.cat((freqs, freqs.new_zeros(freqs.shape[0], pad)), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
            if pad:  # the unrotated features keep cos 1 (transformers never scales them)
                half = self.head_dim // 2
                keep = self.rotary_dim // 2
                cos[:, keep:half] = 1.0
                cos[:, half + keep :] = 1.0
        sin[:, : freqs.shape[1]].neg_()
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def half_angles(
        self, positions: torch.Tensor, dtype: torch.dtype, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and *unsigned* ``sin`` halves ``[num_tokens, head_dim // 2]``: the values
        :meth:`cos_sin` repeats over the two halves of a head (its ``sin`` is this one
        negated on the first half), computed with the same ops, so the two agree bit for bit.
        The fused GPU rotary (``kernels/triton_rotary_kv``) reads angles in this form."""
        freqs = self._freqs(positions, lengths)  # [num_tokens, rotary_dim / 2]
        pad = (self.head_dim - self.rotary_dim) // 2
        if pad:  # features that do not rotate: cos 1, sin 0 (see head_permutation)
            freqs = torch.cat((freqs, freqs.new_zeros(freqs.shape[0], pad)), dim=-1)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
            if pad:
                cos[:, self.rotary_dim // 2 :] = 1.0
        return cos.to(dtype), sin.to(dtype)

    def half_table(
        self, max_positions: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`half_angles` of every position below ``max_positions``, computed once (at
        load time) for the fused GPU rotary to index by position; None where the angles
        depend on more than the position (:attr:`needs_lengths`: dynamic NTK, longrope),
        which are then computed per step."""
        if self.needs_lengths:
            return None
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        return self.half_angles(positions, dtype)


@dataclass(frozen=True, slots=True)
class RotaryAngles:
    """The angles a fused GPU rotary op rotates a step's tokens by: ``cos`` / ``sin`` halves
    ``[rows, head_dim // 2]``, row ``positions[t]`` for token ``t`` (a table computed at
    load time) or, ``positions`` None, row ``t`` (computed for this step)."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor | None


def identity_cos_sin(
    num_tokens: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin that rotate nothing (a no-rope layer served by the rotary ops)."""
    cos = torch.ones(num_tokens, 1, head_dim, dtype=dtype, device=device)
    return cos, torch.zeros_like(cos)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[num_tokens, num_heads, head_dim]``) by the position angles
    (``cos``/``signed_sin`` from :meth:`RotaryEmbedding.cos_sin`).

    Equal, bit for bit, to transformers' ``x * cos + cat(-x2, x1) * sin``: ``flip`` of the
    halves gives ``[x2, x1]`` and the sign lives in ``signed_sin`` (negation is exact).  Q
    and K heads can be rotated in one call by concatenating them."""
    swapped = x.view(*x.shape[:-1], 2, -1).flip(-2).view(x.shape)  # [x2, x1]
    rotated: torch.Tensor = (x * cos) + (swapped * signed_sin)
    return rotated
