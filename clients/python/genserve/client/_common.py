"""What the sync and asyncio clients share: channel options, deadlines, request building."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from genserve.client.params import CHAT_FIELDS, build_parameters, token_ids_batch
from genserve.v1 import generate_pb2 as pb

DEFAULT_TARGET = "localhost:50051"
# genserve accepts 64 MiB messages (long prompts, many top_n alternatives); match it.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # gRPC's reconnect backoff grows to 120 s by default, so a server that comes back (or
    # finishes starting) would go unnoticed for minutes while retries fail fast; cap it at the
    # retry policy's default max_backoff_s.
    ("grpc.max_reconnect_backoff_ms", 5000),
)
Metadata = Sequence[tuple[str, str]]


class Deadline:
    """The absolute end of a call (across its retries); None means no timeout."""

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining_s(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


TokenIds = Sequence[int] | Sequence[Sequence[int]]


def generate_request(
    inputs: str | Sequence[str] | None,
    parameters: Any | None,
    params: Mapping[str, Any],
    input_ids: TokenIds | None = None,
) -> Any:
    """A ``pb.GenerateRequest``; a single string (or one list of ids) becomes a batch of one.
    ``input_ids`` replaces ``inputs``: prompts as token ids, used as they are."""
    built = build_parameters(parameters, params)
    if input_ids is not None:
        if inputs:
            raise TypeError("give inputs or input_ids, not both")
        batch_ids = [pb.TokenIds(ids=ids) for ids in token_ids_batch(input_ids)]
        return pb.GenerateRequest(input_ids=batch_ids, parameters=built)
    if inputs is None:
        raise TypeError("generate needs inputs (text) or input_ids (token ids)")
    batch = [inputs] if isinstance(inputs, str) else list(inputs)
    return pb.GenerateRequest(inputs=batch, parameters=built)


def single_input(inputs: str | Sequence[str] | None, input_ids: TokenIds | None) -> bool:
    """Whether a generate() call names one prompt (its answer is one result, not a list)."""
    if input_ids is not None:
        return bool(input_ids) and all(isinstance(i, int) for i in input_ids)
    return isinstance(inputs, str)


def stream_request(
    inputs: str | None,
    parameters: Any | None,
    params: Mapping[str, Any],
    input_ids: Sequence[int] | None = None,
) -> Any:
    """A ``pb.GenerateStreamRequest`` for one prompt, as text or as token ids."""
    built = build_parameters(parameters, params)
    if input_ids is not None:
        if inputs:
            raise TypeError("give inputs or input_ids, not both")
        return pb.GenerateStreamRequest(input_ids=[int(i) for i in input_ids], parameters=built)
    if not isinstance(inputs, str):
        raise TypeError("generate_stream takes one prompt (a str, or input_ids)")
    return pb.GenerateStreamRequest(inputs=inputs, parameters=built)


ChatMessageLike = Mapping[str, str] | Any  # {"role", "content"[, "name", "tool_call_id"]} or pb


def chat_messages(messages: Sequence[ChatMessageLike]) -> list[Any]:
    """``pb.ChatMessage`` list from dicts (OpenAI's shape) or messages already built."""
    if isinstance(messages, str | Mapping):
        raise TypeError("messages must be a sequence of messages (dicts or pb.ChatMessage)")
    out = []
    for m in messages:
        if isinstance(m, pb.ChatMessage):
            out.append(m)
        elif isinstance(m, Mapping):
            unknown = set(m) - {"role", "content", "name", "tool_call_id"}
            if unknown:
                raise TypeError(f"unknown chat message field(s): {', '.join(sorted(unknown))}")
            out.append(pb.ChatMessage(**m))
        else:
            raise TypeError(f"a chat message is a dict or pb.ChatMessage, not {type(m).__name__}")
    return out


def chat_request(
    stream: bool,
    messages: Sequence[ChatMessageLike],
    parameters: Any | None,
    params: Mapping[str, Any],
) -> Any:
    """A ``pb.ChatRequest`` (or ``pb.ChatStreamRequest``) from :class:`ChatParams` keywords;
    None keeps a default.  ``response_format`` is a type string or a pb.ResponseFormat."""
    cls = pb.ChatStreamRequest if stream else pb.ChatRequest
    options = {k: v for k, v in params.items() if k in CHAT_FIELDS}
    generation = {k: v for k, v in params.items() if k not in CHAT_FIELDS}
    req = cls(messages=chat_messages(messages), parameters=build_parameters(parameters, generation))
    for name, value in options.items():
        if value is None:
            continue
        if name == "response_format":
            fmt = pb.ResponseFormat(type=value) if isinstance(value, str) else value
            req.response_format.CopyFrom(fmt)
        else:
            setattr(req, name, value)
    return req


def tokenize_request(text: str, add_special_tokens: bool | None) -> Any:
    """A ``pb.TokenizeRequest``; None leaves add_special_tokens to the server (true)."""
    req = pb.TokenizeRequest(inputs=text)
    if add_special_tokens is not None:
        req.add_special_tokens = add_special_tokens
    return req
