"""One prompt and its GenerateParameters → one checked :class:`GenerationRequest`.

Mirrors TGI's router validation (stop sequences, truncation, the input and total token
limits, the ``max_new_tokens`` default); the sampling, best_of/n and issue-#15 fields are
checked by their own modules, called from here in a fixed order so that a request with
several faults always gets the same message."""

from __future__ import annotations

from collections.abc import Sequence

from genserve.engine.outputs import GenerationRequest
from genserve.engine.request import StoppingCriteria
from genserve.server.conversion.errors import ValidationError
from genserve.server.conversion.extras import ExtraParams
from genserve.server.conversion.fan_out import num_sequences
from genserve.server.conversion.limits import Limits
from genserve.server.conversion.sampling import sampling_params
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb

DEFAULT_MAX_NEW_TOKENS = 100


def validate(
    req_id: str,
    text: str,
    params: pb.GenerateParameters,
    tokenizer: Tokenizer,
    limits: Limits,
    *,
    prompt_ids: Sequence[int] | None = None,
) -> GenerationRequest:
    """Tokenize and check one input; raises ValidationError.  ``prompt_ids``: the input
    already tokenized (token ids, or a rendered chat), used instead of encoding ``text``."""
    if not text and prompt_ids is None:
        raise ValidationError("`inputs` cannot be empty")
    if len(params.stop) > limits.max_stop_sequences:
        raise ValidationError(
            f"{len(params.stop)} stop sequences; at most {limits.max_stop_sequences} are allowed "
            "(--max-stop-sequences)"
        )
    if any(not s for s in params.stop):
        raise ValidationError("`stop` sequences cannot be empty strings")
    sampling, seed = sampling_params(params, limits)
    num_sequences(params, limits, not sampling.greedy)  # best_of / n checks
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
