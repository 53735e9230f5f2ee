"""Green-list watermarking (Kirchenbauer et al., "A Watermark for Large Language Models",
arXiv:2301.10226), bit-compatible with TGI's ``WatermarkLogitsProcessor``.

For each position the previous token seeds a ``torch.Generator`` with
``HASH_KEY * prev_token``; the first ``int(vocab * gamma)`` ids of ``randperm(vocab)`` drawn
from it are that position's green list, and ``delta`` is added to their logits.  Text sampled
this way holds many more green tokens than the ``gamma`` fraction chance predicts, which
:func:`detect` measures as a z-score without needing the model.

Matching TGI exactly (same key, same generator, same permutation, same logits width) means
text watermarked by either server is detected by the other's detector.

The green list depends only on ``(prev_token, vocab, gamma)``, so masks are cached: a batch
pays one ``randperm`` per distinct previous token not seen recently, and the bias is one
masked add over the watermarked rows.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from genserve.step import SamplingParams

# TGI's key: "a large prime number to create a rng seed with sufficient bit width".
HASH_KEY = 15485863
DEFAULT_GAMMA = 0.5
DEFAULT_DELTA = 2.0

# ~vocab bytes each (a bool mask): 256 x 49152 is 12 MiB.
_CACHE_SIZE = 256
_masks: OrderedDict[tuple[int, int, float, str], torch.Tensor] = OrderedDict()


def greenlist_ids(prev_token: int, vocab: int, gamma: float, device: torch.device) -> torch.Tensor:
    """The green token ids after ``prev_token`` (TGI's ``_get_greenlist_ids``)."""
    rng = torch.Generator(device=device)
    rng.manual_seed(HASH_KEY * prev_token)
    permutation = torch.randperm(vocab, device=device, generator=rng)
    return permutation[: int(vocab * gamma)]


def greenlist_mask(prev_token: int, vocab: int, gamma: float, device: torch.device) -> torch.Tensor:
    """``[vocab]`` bool, True on the green ids after ``prev_token`` (cached, LRU)."""
    key = (prev_token, vocab, gamma, str(device))
    mask = _masks.get(key)
    if mask is not None:
        _masks.move_to_end(key)
        return mask
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[greenlist_ids(prev_token, vocab, gamma, device)] = True
    _masks[key] = mask
    if len(_masks) > _CACHE_SIZE:
        _masks.popitem(last=False)
    return mask


def apply_watermark(
    scores: torch.Tensor,
    rows: Sequence[int],
    prev_tokens: Sequence[int],
    gammas: Sequence[float],
    deltas: Sequence[float],
) -> None:
    """Adds ``deltas[i]`` to the green logits of row ``rows[i]`` of ``scores`` in place.

    ``scores``: ``[num_rows, vocab]``; other rows are untouched."""
    vocab = scores.shape[-1]
    masks = torch.stack(
        [
            greenlist_mask(t, vocab, g, scores.device)
            for t, g in zip(prev_tokens, gammas, strict=True)
        ]
    )  # [len(rows), vocab]
    delta = torch.tensor(deltas, dtype=scores.dtype, device=scores.device)[:, None]
    index = torch.tensor(list(rows), device=scores.device)
    scores[index] = scores[index] + masks.to(scores.dtype) * delta


@dataclass(frozen=True, slots=True)
class Detection:
    num_scored: int  # tokens scored (all but the first, which has no previous token here)
    num_green: int
    green_fraction: float
    z_score: float


def detect(token_ids: Sequence[int], vocab: int, gamma: float = DEFAULT_GAMMA) -> Detection:
    """One-proportion z-test of the paper (section 3): under the null hypothesis (text
    written without knowledge of the green lists) each token is green with probability
    ``gamma``, so ``z = (green - gamma T) / sqrt(T gamma (1 - gamma))``.

    ``token_ids``: the watermarked span preceded by the token that came before it (for a
    completion, the prompt's last token) so that every generated token is scored."""
    device = torch.device("cpu")
    scored = len(token_ids) - 1
    if scored < 1:
        raise ValueError("detection needs at least two tokens")
    green = sum(
        bool(greenlist_mask(prev, vocab, gamma, device)[tok])
        for prev, tok in itertools.pairwise(token_ids)
    )
    expected = gamma * scored
    z = (green - expected) / math.sqrt(scored * gamma * (1.0 - gamma))
    return Detection(scored, green, green / scored, z)


class _Row(Protocol):
    @property
    def params(self) -> SamplingParams: ...
    @property
    def prev_token(self) -> int: ...


def watermark_rows(
    scores: torch.Tensor, logits: torch.Tensor, rows: Sequence[_Row]
) -> torch.Tensor:
    """The sampler's hook: ``scores`` with the watermarked rows biased (a copy of ``logits``
    first when ``scores`` is still it, since prompt logprobs read the model's logits)."""
    marked = [i for i, r in enumerate(rows) if r.params.watermark]
    if not marked:
        return scores
    if scores is logits:
        scores = logits.clone()
    apply_watermark(
        scores,
        marked,
        [rows[i].prev_token for i in marked],
        [rows[i].params.watermark_gamma for i in marked],
        [rows[i].params.watermark_delta for i in marked],
    )
    return scores
