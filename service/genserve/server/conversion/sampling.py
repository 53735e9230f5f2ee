"""GenerateParameters' sampling fields → the engine's :class:`SamplingParams`, checked.

Mirrors TGI's router: the same ranges and messages, and the same rule that any warper
(temperature other than 0 or 1, top-k, top-p, typical-p, min-p) implies sampling."""

from __future__ import annotations

import secrets

from genserve.server.conversion.errors import ValidationError
from genserve.server.conversion.limits import Limits
from genserve.step import SamplingParams
from genserve.v1 import generate_pb2 as pb


def _check_range(name: str, value: float, low: float, high: float) -> None:
    """Checks low < value <= high."""
    if not low < value <= high:
        raise ValidationError(f"`{name}` must be in ({low:g}, {high:g}], got {value:g}")


def _check_penalty(name: str, value: float) -> None:
    if not -2.0 <= value <= 2.0:
        raise ValidationError(f"`{name}` must be in [-2, 2] (0 disables it), got {value:g}")


def sampling_params(
    params: pb.GenerateParameters, limits: Limits
) -> tuple[SamplingParams, int | None]:
    """The checked sampling settings and the request's seed (None when greedy: a greedy
    request reports no seed); raises :class:`ValidationError`."""
    temperature = params.temperature if params.HasField("temperature") else 1.0
    if params.HasField("temperature") and temperature < 0:
        raise ValidationError(f"`temperature` must be strictly positive, got {temperature:g}")
    top_k = params.top_k if params.HasField("top_k") else 0
    if top_k < 0:
        raise ValidationError(f"`top_k` must be >= 0 (0 disables it), got {top_k}")
    top_p = params.top_p if params.HasField("top_p") else 1.0
    _check_range("top_p", top_p, 0.0, 1.0)
    typical_p = params.typical_p if params.HasField("typical_p") else 1.0
    _check_range("typical_p", typical_p, 0.0, 1.0)
    repetition_penalty = params.repetition_penalty if params.HasField("repetition_penalty") else 1.0
    if repetition_penalty <= 0:
        raise ValidationError(
            f"`repetition_penalty` must be strictly positive (1.0 disables it), "
            f"got {repetition_penalty:g}"
        )
    # OpenAI's and TGI's range; a negative penalty favours repetition.
    frequency_penalty = params.frequency_penalty if params.HasField("frequency_penalty") else 0.0
    _check_penalty("frequency_penalty", frequency_penalty)
    presence_penalty = params.presence_penalty if params.HasField("presence_penalty") else 0.0
    _check_penalty("presence_penalty", presence_penalty)
    output_frequency_penalty = (
        params.output_frequency_penalty if params.HasField("output_frequency_penalty") else 0.0
    )
    _check_penalty("output_frequency_penalty", output_frequency_penalty)
    top_n = params.top_n_tokens if params.HasField("top_n_tokens") else 0
    if top_n > limits.max_top_n_tokens:
        raise ValidationError(
            f"`top_n_tokens` is {top_n}; at most {limits.max_top_n_tokens} are allowed "
            "(--max-top-n-tokens)"
        )
    # As TGI: any warper implies sampling.  A temperature of exactly 0 without do_sample is
    # accepted as greedy (what OpenAI-style clients send).
    sample = params.do_sample or (
        (params.HasField("temperature") and temperature not in (0.0, 1.0))
        or top_k > 0
        or top_p < 1.0
        or typical_p < 1.0
        or (params.HasField("min_p") and params.min_p > 0.0)
    )
    if sample and temperature <= 0:
        raise ValidationError(
            f"`temperature` must be strictly positive when sampling, got {temperature:g}"
        )
    seed: int | None = None
    if sample:
        seed = params.seed if params.HasField("seed") else secrets.randbits(63)
    sampling = SamplingParams(
        temperature=temperature if sample else 0.0,
        top_k=top_k if sample else 0,
        top_p=top_p if sample else 1.0,
        typical_p=typical_p if sample else 1.0,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        output_frequency_penalty=output_frequency_penalty,
        seed=seed or 0,
        num_top_tokens=top_n,
        prompt_logprobs=params.decoder_input_details,
        watermark=params.watermark,
        watermark_gamma=limits.watermark_gamma,
        watermark_delta=limits.watermark_delta,
    )
    return sampling, seed
