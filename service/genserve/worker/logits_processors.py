"""Issue #15 logits controls, batched over the rows of one sampling step.

* :func:`apply_logit_controls` — ``logit_bias`` (OpenAI / vLLM: added to the raw logits) and
  the ``min_new_tokens`` ban (transformers' MinNewTokensLengthLogitsProcessor, vLLM's
  min_tokens: EOS and stop token ids get ``-inf`` while too few tokens were generated).  Both
  run before the penalties, where vLLM applies them, and reach greedy rows too.
* :func:`min_p_filter` — transformers' MinPLogitsWarper (a sampling warper: after
  temperature, top-k and top-p, before typical-p).

Each is one indexed tensor operation over the rows that use it; the Python loops walk only
the (few) biased or banned ids of a row, never the vocabulary, and rows at neutral values
are left exactly as they were.  Nothing here draws randomness, so seeded sampling stays a
function of the row alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from genserve.step import SamplingParams
from genserve.worker.device_io import DeviceIO


def apply_logit_controls(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    output_indices: Sequence[int],
    io: DeviceIO | None = None,
) -> torch.Tensor:
    """``logits`` ``[num_rows, vocab]``; row ``i`` belongs to a request with ``params[i]``
    about to sample its output token number ``output_indices[i]`` (from 0).  Returns
    ``logits`` itself when no row uses a control, otherwise a copy with every row's biases
    added and, for rows below their ``min_new_tokens``, the banned ids set to ``-inf``.
    ``io`` uploads the ids and values (asynchronously on a device with transfers)."""
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, (p, output_index) in enumerate(zip(params, output_indices, strict=True)):
        for token_id, bias in p.logit_bias:
            bias_rows.append(i)
            bias_ids.append(token_id)
            bias_values.append(bias)
        if output_index < p.min_new_tokens and p.min_tokens_banned_ids:
            ban_rows += [i] * len(p.min_tokens_banned_ids)
            ban_ids += p.min_tokens_banned_ids
    if not bias_rows and not ban_rows:
        return logits
    scores = logits.clone()  # logits stay the model's: reported logprobs read them
    upload = (io if io is not None else DeviceIO(logits.device)).upload
    if bias_rows:
        at = (upload(bias_rows, torch.int64), upload(bias_ids, torch.int64))
        scores.index_put_(at, upload(bias_values, scores.dtype), accumulate=True)
    if ban_rows:
        at = (upload(ban_rows, torch.int64), upload(ban_ids, torch.int64))
        # A 0-dim host scalar: passed to the kernel as an argument, no copy.
        scores.index_put_(at, torch.tensor(float("-inf"), dtype=scores.dtype))
    return scores


def min_p_filter(scores: torch.Tensor, min_p: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p[i]`` times row ``i``'s largest one.

    Compared in logit space — ``p / p_max = exp(s - s_max)``, so the cut is
    ``s < s_max + log(min_p)`` — which needs no softmax over the vocabulary.  The most
    likely token always survives (transformers' ``min_tokens_to_keep=1``); a row with
    ``min_p == 0`` gets a cut at ``-inf`` and keeps every token."""
    if not isinstance(min_p, torch.Tensor):
        min_p = torch.tensor(list(min_p), dtype=scores.dtype, device=scores.device)
    factor = min_p[:, None]  # [n, 1]
    threshold = scores.amax(dim=-1, keepdim=True) + factor.log()  # [n, 1]
    return scores.masked_fill(scores < threshold, float("-inf"))
