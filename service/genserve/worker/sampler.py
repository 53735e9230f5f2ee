"""Logits → next tokens for a batch of rows with heterogeneous sampling parameters.

Order of operations (TGI's, presence penalty after frequency as vLLM applies them
together; logit bias and min_new_tokens bans first and min-p after top-p as in
worker/logits_processors.py): logit bias / bans → repetition penalty → frequency penalty →
presence penalty → temperature → top-k → top-p → min-p → typical-p → draw.  Greedy rows
take the argmax after the penalties.  Every filter is one tensor operation over the rows
that use it; rows that leave a parameter at its neutral value are not touched.

Randomness is a pure function of ``(seed, output_index)``: each sampled row takes one
uniform number from a splitmix64 hash of both and picks its token by inverse CDF (the first
token whose cumulative probability exceeds it).  A seeded request therefore samples the same
tokens whatever else is in the batch, after a preemption recomputes it, and when its
positions are verified several at a time (speculative decoding).  One number per row, not a
vocabulary's worth of noise from a per-row generator: that cost 27 ms per step at 32 rows.

Reported logprobs (chosen token and top alternatives) are those of the unmodified model
distribution, ``log_softmax(logits)``, before penalties and temperature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.step import SamplingParams, TokenLogprob
from genserve.worker.logits_processors import apply_logit_controls, min_p_filter
from genserve.worker.watermark import watermark_rows

if TYPE_CHECKING:
    from genserve.engine.grammar import BitmaskApplier

_MASK64 = (1 << 64) - 1


def row_uniform(seed: int, output_index: int) -> float:
    """The row's uniform draw in ``[0, 1)``: the top 53 bits of :func:`row_seed`."""
    return (row_seed(seed, output_index) >> 10) * 2.0**-53


def row_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed mixing the request seed and the output position (splitmix64
    finaliser), so consecutive positions get unrelated streams."""
    x = (seed * 0x9E3779B97F4A7C15 + output_index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


@dataclass(frozen=True, slots=True)
class SamplingRow:
    """What the sampler needs about the request behind one row of logits.

    ``token_counts`` (``[vocab]`` float32, occurrences over prompt + output) is required
    only when the request uses a repetition or frequency penalty; ``num_tokens`` is the
    prompt + output length, which normalises the frequency penalty as TGI does.
    """

    params: SamplingParams
    output_index: int
    num_tokens: int = 0
    token_counts: torch.Tensor | None = None
    # [vocab] float32 occurrences over the output only; required with a presence penalty.
    output_counts: torch.Tensor | None = None
    prev_token: int = -1  # the token before this position (seeds the watermark green list)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_tokens: list[tuple[TokenLogprob, ...]]


def _uses_penalty(p: SamplingParams) -> bool:
    return p.uses_penalties


class Sampler:
    """Stateless but for the grammar mask's scatter buffer; one instance per runner."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._grammar_mask: BitmaskApplier | None = None  # made on the first constrained step

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar_bitmask: torch.Tensor | None = None,
        grammar_rows: Sequence[int] = (),
    ) -> SamplerOutput:
        """``logits``: float32 ``[num_rows, vocab]``, one row per entry of ``rows``.
        ``grammar_bitmask[i]`` (xgrammar's packed int32 layout) masks row ``grammar_rows[i]``
        after the penalties, before temperature and filtering; other rows are untouched."""
        num_rows = len(rows)
        params = [r.params for r in rows]
        max_top = max((p.num_top_tokens for p in params), default=0)
        # Without top alternatives only the chosen tokens' log-probabilities are reported:
        # on CPU one C++ pass gives each row's argmax, maximum and log-sum-exp instead of a
        # [num_rows, vocab] log_softmax and argmax (32 float32 streams: 58.5 -> 56.3 ms a step).
        stats = None if max_top else _greedy_stats(logits)
        # log_softmax is one vectorised pass (logsumexp + subtract measured 3x slower).
        logprobs = torch.log_softmax(logits, dim=-1) if stats is None else None

        # logit_bias and min_new_tokens bans come first, as vLLM applies them (a copy if any).
        scores = apply_logit_controls(logits, params, [r.output_index for r in rows])
        scores = watermark_rows(scores, logits, rows)  # TGI: before the penalties
        penalised = [i for i, p in enumerate(params) if _uses_penalty(p)]
        if penalised:
            if scores is logits:
                scores = logits.clone()
            scores[penalised] = self._apply_penalties(
                scores[penalised], [rows[i] for i in penalised]
            )

        if grammar_bitmask is not None and grammar_rows:
            if scores is logits:
                scores = logits.clone()  # logits stay the model's (prompt logprobs read them)
            if self._grammar_mask is None:
                from genserve.engine.grammar import BitmaskApplier  # only constrained steps

                self._grammar_mask = BitmaskApplier()
            self._grammar_mask(scores, grammar_bitmask, list(grammar_rows))

        # [num_rows]; kept for greedy rows (stats' own tensor: nothing else reads it)
        token_ids = stats[0] if stats is not None and scores is logits else first_argmax(scores)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            picked = self._sample(scores[sampled], [rows[i] for i in sampled])
            token_ids[sampled] = picked

        if stats is not None:  # log_softmax's (x - max) - log(sum(exp(x - max)))
            chosen = (logits.gather(1, token_ids[:, None])[:, 0] - stats[1]) - stats[2]
        else:
            assert logprobs is not None
            chosen = logprobs.gather(1, token_ids[:, None])[:, 0]  # [num_rows]
        top_tokens: list[tuple[TokenLogprob, ...]] = [()] * num_rows
        if max_top:
            assert logprobs is not None
            top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top]
            top_lp = top_values.tolist()
            top_id_list = top_ids.tolist()
            for i, p in enumerate(params):
                n = p.num_top_tokens
                top_tokens[i] = tuple(
                    TokenLogprob(t, lp)
                    for t, lp in zip(top_id_list[i][:n], top_lp[i][:n], strict=True)
                )
        return SamplerOutput(token_ids.tolist(), chosen.tolist(), top_tokens)

    def _apply_penalties(self, scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        # scores: [n, vocab] (a copy); counts: [n, vocab]
        counts = torch.stack([_counts(r) for r in rows])
        rep = torch.tensor([r.params.repetition_penalty for r in rows], device=self.device)[:, None]
        seen = counts > 0
        # HF/TGI repetition penalty: divide positive logits, multiply negative ones.
        penalised = torch.where(scores < 0, scores * rep, scores / rep)
        scores = torch.where(seen, penalised, scores)
        freq = torch.tensor([r.params.frequency_penalty for r in rows], device=self.device)
        if bool((freq != 0).any()):
            lengths = torch.tensor([max(r.num_tokens, 1) for r in rows], device=self.device)
            scores = scores - counts / lengths[:, None] * freq[:, None]
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=self.device)
        if bool((presence != 0).any()):
            # OpenAI/vLLM: subtracted once for each distinct token already generated.
            present = torch.stack(
                [
                    _output_counts(r) if r.params.presence_penalty != 0.0 else torch.zeros_like(c)
                    for r, c in zip(rows, counts, strict=True)
                ]
            )
            scores = scores - (present > 0).to(scores.dtype) * presence[:, None]
        out_freq = [r.params.output_frequency_penalty for r in rows]
        if any(f != 0.0 for f in out_freq):
            # OpenAI/vLLM frequency_penalty: penalty x times generated so far (issue #27).
            generated = torch.stack(
                [
                    _output_counts(r) if f != 0.0 else torch.zeros_like(c)
                    for r, c, f in zip(rows, counts, out_freq, strict=True)
                ]
            )
            scores = scores - generated * torch.tensor(out_freq, device=self.device)[:, None]
        return scores

    def _sample(self, scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Draw one token per row from the filtered, tempered distribution."""
        params = [r.params for r in rows]
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        scores = scores / temperature[:, None]  # [n, vocab]
        if any(p.top_k > 0 for p in params):
            scores = _top_k(scores, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            scores = _top_p(scores, [p.top_p for p in params])
        if any(p.min_p > 0.0 for p in params):  # transformers' order: after top-p
            scores = min_p_filter(scores, [p.min_p for p in params])
        if any(p.typical_p < 1.0 for p in params):
            scores = _typical_p(scores, [p.typical_p for p in params])
        probs = torch.softmax(scores, dim=-1)  # [n, vocab]
        cumulative = probs.cumsum(dim=-1)
        uniform = torch.tensor(
            [row_uniform(r.params.seed, r.output_index) for r in rows],
            dtype=cumulative.dtype,
            device=self.device,
        )
        # Scaled by the row's own total, so rounding in the float32 sum biases nothing.
        target = (uniform * cumulative[:, -1])[:, None]
        vocab = probs.shape[-1]
        picked = torch.searchsorted(cumulative, target, right=True).clamp_(max=vocab - 1)
        # Filtered tokens add nothing to the sum, so the search never stops on one, except
        # when rounding puts the target at the very end: then take the last allowed token.
        stray = probs.gather(1, picked)[:, 0] == 0
        if bool(stray.any()):
            for i in stray.nonzero()[:, 0].tolist():
                picked[i, 0] = int((probs[i] > 0).nonzero()[-1, 0])
        return picked[:, 0]


_ARGMAX_CHUNK = 1024


def _greedy_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``genserve::greedy_stats`` of float32 CPU logits (first argmax, maximum and log-sum-exp
    of each row), or None where torch's path is taken: other devices or dtypes, no CPU
    kernels, or a row that is not all finite (NaN/inf, where torch's semantics decide)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2:
        return None
    if not cpu_kernels.enabled_and_loaded():
        return None
    argmax, peak, log_total = torch.ops.genserve.greedy_stats(logits)
    if not bool(torch.isfinite(log_total).all()):
        return None
    return argmax, peak, log_total


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``[rows, vocab]`` (first index on ties), faster.

    PyTorch's CPU argmax is not vectorised (1 ms for 32 x 49152); the vectorised ``amax``
    over chunks finds each row's first chunk holding the maximum, and argmax then runs only
    inside that chunk.  Falls back to argmax when the vocabulary does not split evenly."""
    rows, vocab = x.shape
    if vocab % _ARGMAX_CHUNK or vocab < 4 * _ARGMAX_CHUNK:
        return x.argmax(dim=-1)
    chunks = x.view(rows, vocab // _ARGMAX_CHUNK, _ARGMAX_CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)  # [rows]
    inside = chunks[torch.arange(rows, device=x.device), best_chunk].argmax(dim=-1)
    return best_chunk * _ARGMAX_CHUNK + inside


def _counts(row: SamplingRow) -> torch.Tensor:
    if row.token_counts is None:
        raise ValueError("a penalised row needs token_counts")
    return row.token_counts


def _output_counts(row: SamplingRow) -> torch.Tensor:
    if row.output_counts is None:
        raise ValueError("a row with an output penalty needs output_counts")
    return row.output_counts


def _top_k(scores: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep scores >= the k-th largest of their row (ties kept); ``k == 0`` keeps all."""
    vocab = scores.shape[-1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    kth = scores.topk(max(ks), dim=-1).values  # [n, max_k], descending
    index = torch.tensor([k - 1 for k in ks], device=scores.device)[:, None]
    threshold = kth.gather(1, index)
    # Rows with k == 0 (or k >= vocab) would otherwise cut at the max_k-th value.
    disabled = torch.tensor([k == 0 for k in top_k], device=scores.device)[:, None]
    threshold = threshold.masked_fill(disabled, float("-inf"))
    return scores.masked_fill(scores < threshold, float("-inf"))


# Candidate counts tried before sorting the whole vocabulary for top-p.
_TOP_P_CANDIDATES = (64, 1024)


def _top_p(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
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
        top_probs, top_ids = probs.topk(k, dim=-1)  # descending
        if not bool(((top_probs.sum(dim=-1) >= p) | (p >= 1.0)).all()):
            continue
        before = top_probs.cumsum(dim=-1) - top_probs  # mass of the more likely tokens
        keep = before < p[:, None]
        keep[:, 0] = True
        remove = torch.ones_like(scores, dtype=torch.bool).scatter_(1, top_ids, ~keep)
        remove.masked_fill_((p >= 1.0)[:, None], False)
        return scores.masked_fill(remove, float("-inf"))
    return _top_p_sorted(scores, top_p)


def _top_p_sorted(scores: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """:func:`_top_p` over the whole sorted vocabulary (HF's algorithm)."""
    sorted_scores, order = scores.sort(dim=-1)  # ascending
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    cut = 1.0 - torch.tensor(top_p, device=scores.device)[:, None]
    remove = cumulative <= cut
    remove[:, -1] = False  # always keep the most likely token
    remove.masked_fill_(cut <= 0, False)  # rows with top_p == 1
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))


def _typical_p(scores: torch.Tensor, mass: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.), as HF's TypicalLogitsWarper."""
    log_probs = scores.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)
    shifted = (-log_probs - entropy).abs()
    sorted_shifted, order = shifted.sort(dim=-1)
    cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    mass_t = torch.tensor(mass, device=scores.device)[:, None]
    last = (cumulative < mass_t).sum(dim=1).clamp(max=scores.shape[-1] - 1)
    remove = sorted_shifted > sorted_shifted.gather(1, last[:, None])
    remove[:, 0] = False  # always keep the most typical token
    remove.masked_fill_(mass_t >= 1.0, False)
    return scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
