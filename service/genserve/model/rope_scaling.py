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
  its own ``L`` (a decode row its own position + 1, a prefill chunk its last position + 1),
  so a request is computed as it would be alone, whatever else is batched with it.  As in
  transformers, keys already in the cache keep the rotation they were computed with.

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


def sequence_lengths(positions: torch.Tensor, num_decodes: int = 0) -> torch.Tensor:
    """``[num_tokens]`` → for each token, 1 + the last position of its sequence in the step.

    The first ``num_decodes`` tokens are decode rows (a speculative chunk's tokens too), each
    the last token of its own sequence: their length is ``position + 1`` whatever their
    neighbours' positions are (two requests at positions 10 and 11 are two sequences, not one
    chunk).  The remaining tokens are prefill chunks, told apart as runs of consecutive
    positions.  No device→host synchronisation (the run buffer has ``num_tokens`` entries, an
    upper bound on the number of runs), so CUDA graphs can capture it.  The model itself reads
    the lengths from its attention metadata (``AttentionMetadata.sequence_lengths``, which
    knows each sequence); this is the default for callers that have positions only."""
    n = positions.shape[0]
    lengths = positions + 1
    if num_decodes >= n:
        return lengths
    chunked = positions[num_decodes:]
    m = chunked.shape[0]
    starts = torch.ones(m, dtype=torch.bool, device=positions.device)
    starts[1:] = chunked[1:] != chunked[:-1] + 1
    run = torch.cumsum(starts.long(), 0) - 1  # [m] run index
    last = torch.full((m,), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, run, chunked, reduce="amax")
    return torch.cat((lengths[:num_decodes], last[run] + 1))


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
