"""The sampler's filters and its draw, as tensor functions over ``[rows, vocab]`` scores
(worker/sampler.py applies them to the rows that use them; worker/sampled_tail.py to every
row of a CUDA graph's bucket).  Each keeps a row whose parameter is neutral bit for bit as
it was, and none but :func:`top_p_filter` and :func:`draw` with ``sync_free=False`` (the
CPU path's fast branches) reads a value back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from genserve.worker.device_io import DeviceIO


def draw(scores: torch.Tensor, uniform: torch.Tensor, sync_free: bool) -> torch.Tensor:
    """One token per row of the filtered, tempered ``scores`` ``[n, vocab]`` by inverse
    CDF at ``uniform`` (float64 ``[n]``): the first token whose cumulative probability
    exceeds it.  ``sync_free``: decide the rounding corner case on the device."""
    probs = torch.softmax(scores, dim=-1)  # [n, vocab]
    cumulative = probs.cumsum(dim=-1)
    # Scaled by the row's own total, so rounding in the float32 sum biases nothing.
    target = (uniform.to(cumulative.dtype) * cumulative[:, -1])[:, None]
    vocab = probs.shape[-1]
    picked = torch.searchsorted(cumulative, target, right=True).clamp_(max=vocab - 1)
    # Filtered tokens add nothing to the sum, so the search never stops on one, except
    # when rounding puts the target at the very end: then take the last allowed token.
    stray = probs.gather(1, picked)[:, 0] == 0
    if sync_free:  # the same choice for every row, decided on the device
        ids = torch.arange(vocab, device=probs.device)
        last_allowed = torch.where(probs > 0, ids, -1).amax(dim=-1)  # [n]
        return torch.where(stray, last_allowed, picked[:, 0])
    if bool(stray.any()):
        for i in stray.nonzero()[:, 0].tolist():
            picked[i, 0] = int((probs[i] > 0).nonzero()[-1, 0])
    return picked[:, 0]


def top_k_filter(
    scores: torch.Tensor,
    top_k: list[int],
    io: DeviceIO | None = None,
    device_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep scores >= the k-th largest of their row (ties kept); ``k == 0`` keeps all.
    ``device_k``: the same ``top_k`` already on the device (int64), read instead of
    uploading (the host list still gives the widest ``k``)."""
    io = io if io is not None else DeviceIO(scores.device)
    vocab = scores.shape[-1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    kth = scores.topk(max(ks), dim=-1).values  # [n, max_k], descending
    if device_k is not None:
        index = (torch.where(device_k > 0, device_k.clamp(max=vocab), vocab) - 1)[:, None]
        disabled = (device_k == 0)[:, None]
    else:
        index = io.upload([k - 1 for k in ks], torch.int64)[:, None]
        # Rows with k == 0 (or k >= vocab) would otherwise cut at the max_k-th value.
        disabled = io.upload([k == 0 for k in top_k], torch.bool)[:, None]
    threshold = kth.gather(1, index)
    threshold = threshold.masked_fill(disabled, float("-inf"))
    return scores.masked_fill(scores < threshold, float("-inf"))


# Candidate counts tried before sorting the whole vocabulary for top-p.
_TOP_P_CANDIDATES = (64, 1024)


def top_p_filter(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Nucleus: drop the least likely tokens whose cumulative mass is <= 1 - top_p (HF).

    Equivalently, keep a token while the mass of the tokens more likely than it is below
    ``top_p``.  When the few most likely tokens already hold ``top_p`` of every row's mass
    (the usual case, and always after a small top-k), only those are ranked: sorting the
    whole vocabulary costs ~65 ms at 32 x 49152 on CPU, ``topk(64)`` ~1.5 ms."""
    vocab = scores.shape[-1]
    p = torch.tensor(top_p, dtype=torch.float32, device=scores.device)
    probs = scores.softmax(dim=-1)
    for k in _TOP_P_CANDIDATES:
        if k >= vocab:
            break
        enough, filtered = top_p_candidates(scores, probs, p, k)
        if not bool(enough):
            continue
        return filtered
    return top_p_sorted(scores, p)


def top_p_sync_free(scores: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """:func:`top_p_filter` without reading anything back: every candidate count and the full
    sort are computed, and the same one :func:`top_p_filter` would take is selected on the device
    (so the two agree bit for bit).  On a GPU the sort is cheap next to a sync."""
    vocab = scores.shape[-1]
    probs = scores.softmax(dim=-1)
    result = top_p_sorted(scores, p)
    for k in reversed(_TOP_P_CANDIDATES):
        if k >= vocab:
            continue
        enough, filtered = top_p_candidates(scores, probs, p, k)
        result = torch.where(enough, filtered, result)
    return result


def top_p_candidates(
    scores: torch.Tensor, probs: torch.Tensor, p: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p among each row's ``k`` most likely tokens: ``(enough, filtered)``, ``enough``
    a 0-dim device bool saying whether those hold ``p`` of every row's mass (only then is
    ``filtered`` the nucleus)."""
    top_probs, top_ids = probs.topk(k, dim=-1)  # descending
    enough = ((top_probs.sum(dim=-1) >= p) | (p >= 1.0)).all()
    before = top_probs.cumsum(dim=-1) - top_probs  # mass of the more likely tokens
    keep = before < p[:, None]
    keep[:, 0] = True
    remove = torch.ones_like(scores, dtype=torch.bool).scatter_(1, top_ids, ~keep)
    remove.masked_fill_((p >= 1.0)[:, None], False)
    return enough, scores.masked_fill(remove, float("-inf"))


def top_p_sorted(scores: torch.Tensor, top_p: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """:func:`top_p_filter` over the whole sorted vocabulary (HF's algorithm); ``top_p``:
    float32 ``[n]`` on the scores' device.  No value-dependent branch (the sync-free path)."""
    top_p = row_values(top_p, scores.device)
    sorted_scores, order = scores.sort(dim=-1)  # ascending
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    cut = 1.0 - top_p[:, None]
    remove = cumulative <= cut
    remove[:, -1] = False  # always keep the most likely token
    remove.masked_fill_(cut <= 0, False)  # rows with top_p == 1
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def typical_p_filter(scores: torch.Tensor, mass: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.), as HF's TypicalLogitsWarper; ``mass``:
    float32 ``[n]`` on the scores' device."""
    mass = row_values(mass, scores.device)
    log_probs = scores.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)
    shifted = (-log_probs - entropy).abs()
    sorted_shifted, order = shifted.sort(dim=-1)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    mass_t = mass[:, None]  # [n, 1] float32
    last = (cumulative < mass_t).sum(dim=1).clamp(max=scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    remove[:, 0] = False  # always keep the most typical token
    remove.masked_fill_(mass_t >= 1.0, False)
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def row_values(values: torch.Tensor | Sequence[float], device: torch.device) -> torch.Tensor:
    """Per-row float32 parameters as a tensor (callers on the sync-free path upload them)."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.tensor(list(values), dtype=torch.float32, device=device)
