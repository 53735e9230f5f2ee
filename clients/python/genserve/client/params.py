"""Building ``GenerateParameters`` from TGI-style keyword arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from genserve.v1 import generate_pb2 as pb


class GenerateParams(TypedDict, total=False):
    """The keyword arguments of generate()/generate_stream(): TGI's parameter names.  Leaving one
    out (or passing None) keeps the server's default."""

    max_new_tokens: int | None
    do_sample: bool | None
    temperature: float | None
    top_k: int | None
    top_p: float | None
    typical_p: float | None
    repetition_penalty: float | None
    frequency_penalty: float | None
    seed: int | None
    stop: Sequence[str] | None
    truncate: int | None
    return_full_text: bool | None
    details: bool | None
    decoder_input_details: bool | None
    top_n_tokens: int | None
    best_of: int | None
    watermark: bool | None
    presence_penalty: float | None
    adapter_id: str | None  # LoRA adapter (LoRAX); None: the server's default adapter
    # vLLM / SGLang sampling fields (issue #15)
    min_p: float | None
    min_new_tokens: int | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool | None
    logit_bias: Mapping[int, float] | None  # token id -> bias added to its logit
    skip_special_tokens: bool | None
    include_stop_str_in_output: bool | None
    # OpenAI's frequency_penalty: penalty x count over the output (issue #27)
    output_frequency_penalty: float | None
    # Results per input (vLLM / OpenAI n; not for streams).  In chat() it is the
    # ChatRequest's n (replies), with the same meaning.
    n: int | None
    # Structured output: a pb.Grammar, or one of its fields as a dict, e.g.
    # {"json_schema": "{...}"}, {"regex": "[0-9]+"}.
    grammar: Any | None


_FIELDS = frozenset(GenerateParams.__annotations__)


class ChatParams(GenerateParams, total=False):
    """The keyword arguments of chat()/chat_stream(): every generation parameter plus
    OpenAI's chat fields.  ``response_format`` is "text", "json_object" or a
    ``pb.ResponseFormat``."""

    logprobs: bool | None
    top_logprobs: int | None
    response_format: Any | None
    model: str | None
    add_generation_prompt: bool | None
    continue_final_message: bool | None


# Chat's own request fields; n is the ChatRequest's (the number of replies).
CHAT_FIELDS = (frozenset(ChatParams.__annotations__) - _FIELDS) | {"n"}


def token_ids_batch(input_ids: Sequence[int] | Sequence[Sequence[int]]) -> list[list[int]]:
    """One prompt's ids (``[1, 2, 3]``) or a batch of them (``[[1, 2], [3]]``) as a batch."""
    ids: list[Any] = list(input_ids)
    if ids and all(isinstance(i, int) for i in ids):
        return [[int(i) for i in ids]]
    return [[int(i) for i in prompt] for prompt in ids]


def build_parameters(base: Any | None, overrides: Mapping[str, Any]) -> Any:
    """A new ``pb.GenerateParameters``: a copy of ``base`` (if given) with every non-None
    keyword of ``overrides`` set.  Raises TypeError for a name that is not a parameter."""
    unknown = set(overrides) - _FIELDS
    if unknown:
        raise TypeError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
    msg = pb.GenerateParameters()
    if base is not None:
        msg.CopyFrom(base)
    for name, value in overrides.items():
        if value is None:
            continue
        if name == "stop":
            if isinstance(value, str):
                raise TypeError("stop must be a sequence of strings, not one string")
            msg.stop[:] = list(value)
        elif name == "stop_token_ids":
            msg.stop_token_ids[:] = list(value)
        elif name == "logit_bias":
            msg.logit_bias.clear()
            msg.logit_bias.update({int(k): float(v) for k, v in value.items()})
        elif name == "grammar":
            grammar = pb.Grammar(**value) if isinstance(value, Mapping) else value
            msg.grammar.CopyFrom(grammar)
        else:
            setattr(msg, name, value)
    return msg
