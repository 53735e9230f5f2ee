"""Request validation: protobuf parameters → a GenerationRequest, or a message a person can
act on.  Mirrors TGI's router validation (limits, defaults, implied sampling)."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from genserve.engine.outputs import GenerationRequest
from genserve.engine.request import StoppingCriteria
from genserve.step import SamplingParams
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 100


class ValidationError(ValueError):
    """Bad input: answered with INVALID_ARGUMENT."""


class UnsupportedError(ValueError):
    """A valid request for something this server does not do: answered with UNIMPLEMENTED."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    max_client_batch_size: int
    vocab_size: int = 0  # the model's logits width; 0: the tokenizer's vocabulary size
    watermark_gamma: float = 0.5  # --watermark-gamma
    watermark_delta: float = 2.0  # --watermark-delta
    # The flag (or cause) that set max_input_tokens / max_total_tokens, cited when refusing.
    input_limit_source: str = "--max-input-tokens"
    total_limit_source: str = "--max-total-tokens"


def validate_batch_size(num_inputs: int, limits: Limits) -> None:
    if num_inputs == 0:
        raise ValidationError("`inputs` is empty: send at least one prompt")
    if num_inputs > limits.max_client_batch_size:
        raise ValidationError(
            f"{num_inputs} inputs in one request; at most {limits.max_client_batch_size} are "
            "allowed (--max-client-batch-size)"
        )


def _check_range(name: str, value: float, low: float, high: float) -> None:
    """Checks low < value <= high."""
    if not low < value <= high:
        raise ValidationError(f"`{name}` must be in ({low:g}, {high:g}], got {value:g}")


def _check_penalty(name: str, value: float) -> None:
    if not -2.0 <= value <= 2.0:
        raise ValidationError(f"`{name}` must be in [-2, 2] (0 disables it), got {value:g}")


def _sampling(params: pb.GenerateParameters, limits: Limits) -> tuple[SamplingParams, int | None]:
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
        seed=seed or 0,
        num_top_tokens=top_n,
        prompt_logprobs=params.decoder_input_details,
        watermark=params.watermark,
        watermark_gamma=limits.watermark_gamma,
        watermark_delta=limits.watermark_delta,
    )
    return sampling, seed


def validate(
    req_id: str,
    text: str,
    params: pb.GenerateParameters,
    tokenizer: Tokenizer,
    limits: Limits,
    *,
    prompt_ids: Sequence[int] | None = None,
) -> GenerationRequest:
    """Tokenize and check one input; raises ValidationError or UnsupportedError.
    ``prompt_ids``: the input already tokenized (a rendered chat), used instead of
    encoding ``text``."""
    if not text and prompt_ids is None:
        raise ValidationError("`inputs` cannot be empty")
    if len(params.stop) > limits.max_stop_sequences:
        raise ValidationError(
            f"{len(params.stop)} stop sequences; at most {limits.max_stop_sequences} are allowed "
            "(--max-stop-sequences)"
        )
    if any(not s for s in params.stop):
        raise ValidationError("`stop` sequences cannot be empty strings")
    sampling, seed = _sampling(params, limits)
    from genserve.server.best_of import num_sequences  # imports this module

    num_sequences(params, limits, not sampling.greedy)  # best_of / n checks
    from genserve.server.param_validation import ExtraParams  # imports this module

    extras = ExtraParams.check(params, limits.vocab_size or tokenizer.vocab_size)

    prompt_ids = tokenizer.encode(text) if prompt_ids is None else list(prompt_ids)
    if params.HasField("truncate"):
        if not 0 < params.truncate <= limits.max_input_tokens:
            raise ValidationError(
                f"`truncate` must be in (0, {limits.max_input_tokens}], got {params.truncate}"
            )
        prompt_ids = prompt_ids[-params.truncate :]
    num_input = len(prompt_ids)
    if num_input == 0:
        raise ValidationError("`inputs` tokenizes to no tokens")
    if num_input > limits.max_input_tokens:
        raise ValidationError(
            f"`inputs` must have at most {limits.max_input_tokens} tokens "
            f"({limits.input_limit_source}); given: {num_input}. Shorten the prompt or set "
            "`truncate`"
        )
    room = limits.max_total_tokens - num_input
    if params.HasField("max_new_tokens"):
        max_new_tokens = params.max_new_tokens
        if max_new_tokens == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
    else:
        max_new_tokens = min(DEFAULT_MAX_NEW_TOKENS, room)
    if max_new_tokens > room or room <= 0:
        raise ValidationError(
            f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens} "
            f"({limits.total_limit_source}); given: {num_input} input tokens and {max_new_tokens} "
            "`max_new_tokens`"
        )
    request = GenerationRequest(
        req_id=req_id,
        prompt_token_ids=tuple(prompt_ids),
        sampling=sampling,
        stopping=StoppingCriteria(
            max_new_tokens=max_new_tokens, eos_token_ids=tokenizer.eos_token_ids
        ),
        stop=tuple(params.stop),
        seed=seed,
        adapter_id=params.adapter_id or None,
    )
    return extras.apply(request)
