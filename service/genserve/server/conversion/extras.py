"""Issue #15 request fields: min_p, min_new_tokens, stop_token_ids, ignore_eos, logit_bias,
skip_special_tokens, include_stop_str_in_output, and prompts given as token ids.

Checked before a request is queued (``ValidationError`` → INVALID_ARGUMENT, with the field
named), then folded into the engine's request by :meth:`ExtraParams.apply`.  Token ids are
bounded by the model's logits width (``InfoResponse.vocab_size``), the one bound that keeps
every index into the logits and the embedding table valid."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from genserve.engine.outputs import GenerationRequest
from genserve.server.conversion.errors import ValidationError
from genserve.v1 import generate_pb2 as pb

# OpenAI's (and vLLM's) range for a logit bias.
MAX_ABS_LOGIT_BIAS = 100.0


def _check_ids(name: str, ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    ids = tuple(ids)
    bad = [i for i in ids if i >= vocab_size]
    if bad:
        raise ValidationError(
            f"`{name}` holds token id {bad[0]}, outside the vocabulary (ids are below {vocab_size})"
        )
    return ids


def check_input_ids(ids: Iterable[int], vocab_size: int) -> tuple[int, ...]:
    """A prompt given as token ids: non-empty, every id in the vocabulary.  (Its length is
    checked with the text prompts', after truncation.)"""
    checked = _check_ids("input_ids", ids, vocab_size)
    if not checked:
        raise ValidationError("`input_ids` is empty: give at least one token id")
    return checked


@dataclass(frozen=True, slots=True)
class ExtraParams:
    """The checked issue-#15 fields of one GenerateParameters."""

    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def check(cls, params: pb.GenerateParameters, vocab_size: int) -> ExtraParams:
        """Range checks that need nothing but the parameters and the vocabulary size."""
        min_p = params.min_p if params.HasField("min_p") else 0.0
        if not 0.0 <= min_p <= 1.0:
            raise ValidationError(f"`min_p` must be in [0, 1] (0 disables it), got {min_p:g}")
        stop_ids = _check_ids("stop_token_ids", params.stop_token_ids, vocab_size)
        bias_ids = _check_ids("logit_bias", sorted(params.logit_bias), vocab_size)
        bias = tuple((i, float(params.logit_bias[i])) for i in bias_ids)
        for token_id, value in bias:
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValidationError(
                    f"`logit_bias` of token {token_id} is {value:g}; biases must be in "
                    f"[-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]"
                )
        min_new_tokens = params.min_new_tokens if params.HasField("min_new_tokens") else 0
        if min_new_tokens and params.HasField("grammar"):
            # A grammar may allow nothing but EOS once its output is complete; banning EOS
            # there would leave no token to choose.
            raise ValidationError(
                "`min_new_tokens` cannot be combined with `grammar` (or a chat "
                "`response_format`): the grammar decides where the output may end"
            )
        return cls(
            min_p=min_p,
            min_new_tokens=min_new_tokens,
            stop_token_ids=tuple(dict.fromkeys(stop_ids)),
            ignore_eos=params.ignore_eos,
            logit_bias=tuple((i, v) for i, v in bias if v != 0.0),
            skip_special_tokens=(
                params.skip_special_tokens if params.HasField("skip_special_tokens") else True
            ),
            include_stop_str_in_output=params.include_stop_str_in_output,
        )

    def apply(self, req: GenerationRequest) -> GenerationRequest:
        """``req`` with these fields in its sampling, stopping and decoding settings; raises
        ValidationError when ``min_new_tokens`` exceeds the request's ``max_new_tokens``."""
        max_new_tokens = req.stopping.max_new_tokens
        if self.min_new_tokens > max_new_tokens:
            raise ValidationError(
                f"`min_new_tokens` ({self.min_new_tokens}) must be <= `max_new_tokens` "
                f"({max_new_tokens})"
            )
        # As vLLM's min_tokens: EOS (unless ignored) and the stop ids are what it holds back.
        eos = () if self.ignore_eos else tuple(sorted(req.stopping.eos_token_ids))
        banned = tuple(dict.fromkeys(eos + self.stop_token_ids)) if self.min_new_tokens else ()
        sampling = dataclasses.replace(
            req.sampling,
            min_p=0.0 if req.sampling.greedy else self.min_p,
            min_new_tokens=self.min_new_tokens if banned else 0,
            min_tokens_banned_ids=banned,
            logit_bias=self.logit_bias,
        )
        stopping = dataclasses.replace(
            req.stopping, ignore_eos=self.ignore_eos, stop_token_ids=frozenset(self.stop_token_ids)
        )
        return dataclasses.replace(
            req,
            sampling=sampling,
            stopping=stopping,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
