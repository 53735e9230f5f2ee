"""``--rope-scaling linear|dynamic`` / ``--rope-factor`` (TGI's flags) and dynamic NTK rotary.

The flags rewrite the model's rotary config the way a ``rope_scaling`` entry in
``config.json`` would (transformers' ``{"rope_type": ..., "factor": ...}``), so the model is
computed exactly as transformers computes it with that config:

* ``linear`` (position interpolation): every inverse frequency divided by ``factor``
  (model/layers.py already implements it for checkpoints that ship it).
* ``dynamic`` (NTK-aware, transformers' ``_compute_dynamic_ntk_parameters``): unchanged up
  to ``max_position_embeddings``; past it the base becomes
  ``theta * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))`` where ``L`` is the
  sequence length at the time the token is computed.  transformers takes ``L`` as
  ``max(position_ids) + 1`` of the forward pass; here each sequence of the flat batch gets
  its own ``L`` (the last position of its run in this step), so a request is computed as it
  would be alone, whatever else is batched with it.  As in transformers, keys already in the
  cache keep the rotation they were computed with.

TGI, given only ``--rope-factor``, uses linear scaling; given only ``--rope-scaling``, a
factor of 1.  The derived default ``max_total_tokens`` grows by ``factor`` (TGI does the
same with ``max_position_embeddings``).
"""

from __future__ import annotations

import dataclasses

import torch

from genserve.model.spec import RopeConfig


def override(
    rope: RopeConfig, scaling: str | None, factor: float | None, max_pos: int
) -> RopeConfig:
    """``rope`` with the flags applied; unchanged when neither flag is given."""
    if scaling is None and factor is None:
        return rope
    kind = scaling or "linear"
    if kind not in ("linear", "dynamic"):
        raise ValueError(f"--rope-scaling must be linear or dynamic, got {kind!r}")
    params = {"factor": float(factor if factor is not None else 1.0)}
    if kind == "dynamic":
        params["original_max_position_embeddings"] = float(max_pos)
    return dataclasses.replace(rope, rope_type=kind, params=params)


def scaled_max_positions(max_pos: int, scaling: str | None, factor: float | None) -> int:
    """The context the scaled model is meant for (TGI: ``max_position_embeddings * factor``)."""
    if scaling is None and factor is None:
        return max_pos
    return int(max_pos * (factor if factor is not None else 1.0))


def sequence_lengths(positions: torch.Tensor) -> torch.Tensor:
    """``[num_tokens]`` → for each token, 1 + the last position of its run of consecutive
    positions (one run per sequence in the flat batch)."""
    n = positions.shape[0]
    starts = torch.ones(n, dtype=torch.bool, device=positions.device)
    starts[1:] = positions[1:] != positions[:-1] + 1
    run = torch.cumsum(starts.long(), 0) - 1  # [num_tokens] run index
    last = torch.full((int(run[-1]) + 1,), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, run, positions, reduce="amax")
    return last[run] + 1


def dynamic_freqs(
    positions: torch.Tensor, rope: RopeConfig, head_dim: int, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """``positions [num_tokens]`` → angles ``[num_tokens, head_dim // 2]`` under dynamic NTK;
    ``lengths``: each token's sequence length (default: :func:`sequence_lengths`)."""
    max_pos = rope.params["original_max_position_embeddings"]
    factor = rope.params["factor"]
    if lengths is None:
        lengths = sequence_lengths(positions)
    lengths = lengths.float().clamp(min=max_pos)  # [num_tokens]
    base = rope.theta * ((factor * lengths / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    exponents = exponents / head_dim  # [head_dim/2], as transformers (float32 exponents)
    # transformers computes inv_freq in float32 from a python-float base; so do we.
    inv_freq = 1.0 / (base[:, None] ** exponents[None, :])
    return positions[:, None].float() * inv_freq
