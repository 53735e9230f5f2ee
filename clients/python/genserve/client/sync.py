"""The blocking client."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import grpc

from genserve.client._common import (
    CHANNEL_OPTIONS,
    DEFAULT_TARGET,
    ChatMessageLike,
    Deadline,
    Metadata,
    TokenIds,
    chat_request,
    generate_request,
    single_input,
    stream_request,
    tokenize_request,
)
from genserve.client.auth import api_key_metadata
from genserve.client.errors import UnavailableError, error_from_rpc, status_of
from genserve.client.retry import RetryPolicy
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from typing import Self, Unpack

    from genserve.client.params import ChatParams, GenerateParams


class Client:
    """Blocking client for one genserve server.  Thread-safe; use as a context manager or
    call :meth:`close`.

    ``timeout`` (seconds) bounds each call including its retries, unless a call passes its own;
    ``retry`` governs retries on UNAVAILABLE; ``credentials`` switches to TLS; ``channel`` uses
    a channel the caller made (and keeps owning); ``metadata`` is sent with every call."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        channel: grpc.Channel | None = None,
        metadata: Metadata = (),
        api_key: str | None = None,
    ) -> None:
        self._owns_channel = channel is None
        if channel is None:
            channel = (
                grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)
                if credentials is not None
                else grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
            )
        self._channel = channel
        self._stub = pb_grpc.TextGenerationServiceStub(channel)
        self._timeout = timeout
        self._retry = retry if retry is not None else RetryPolicy()
        self._metadata = (*metadata, *api_key_metadata(api_key))  # api_key: --api-key servers

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @overload
    def generate(
        self,
        inputs: str,
        *,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Any: ...

    @overload
    def generate(
        self,
        inputs: Sequence[str],
        *,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> list[Any]: ...

    @overload
    def generate(
        self,
        inputs: None = None,
        *,
        input_ids: TokenIds,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Any: ...

    def generate(
        self,
        inputs: str | Sequence[str] | None = None,
        *,
        input_ids: TokenIds | None = None,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Any:
        """Complete ``inputs``.  One string gives one ``pb.GenerateResult``; a sequence (at most
        the server's max_client_batch_size) gives a list of them in input order.  Parameters
        come from ``parameters`` (a ``pb.GenerateParameters``) overridden by keyword arguments
        with TGI's names (max_new_tokens=..., temperature=..., stop=[...], details=True...).
        ``input_ids`` instead of ``inputs``: prompts as token ids (one list, or a list of
        them), used as they are (no BOS added).  With ``n > 1`` a prompt has ``n`` results,
        returned as a list (prompt by prompt)."""
        request = generate_request(inputs, parameters, params, input_ids)
        response = self._unary(self._stub.Generate, request, timeout)
        results = list(response.results)
        # n > 1: a prompt's n results, as a list.
        return results[0] if single_input(inputs, input_ids) and len(results) == 1 else results

    def generate_stream(
        self,
        inputs: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[GenerateParams],
    ) -> Iterator[Any]:
        """Complete one prompt, yielding one ``pb.GenerateStreamResponse`` per token; the last
        also has ``generated_text`` and ``details``.  Closing the iterator early (``break``)
        cancels the call.  Retried on UNAVAILABLE only until the first message arrives."""
        request = stream_request(inputs, parameters, params, input_ids)
        return self._stream(request, timeout)

    def chat(
        self,
        messages: Sequence[ChatMessageLike],
        *,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[ChatParams],
    ) -> Any:
        """Reply to a conversation rendered with the model's chat template: a
        ``pb.ChatResponse`` (``choices[i].message.content``, ``finish_reason``, ``usage``).
        ``messages`` are dicts ``{"role", "content"}`` (OpenAI's shape) or ``pb.ChatMessage``;
        keywords: OpenAI's n, logprobs, top_logprobs, response_format, model ... and the
        sampling ones of :meth:`generate` (max_new_tokens, temperature, seed, stop,
        presence_penalty ...).  FailedPreconditionError when the server has no chat template."""
        request = chat_request(False, messages, parameters, params)
        return self._unary(self._stub.Chat, request, timeout)

    def chat_stream(
        self,
        messages: Sequence[ChatMessageLike],
        *,
        parameters: Any | None = None,
        timeout: float | None = None,
        **params: Unpack[ChatParams],
    ) -> Iterator[Any]:
        """:meth:`chat` as one ``pb.ChatStreamResponse`` per generated token (``index`` says
        which choice, ``delta`` the text it adds); each choice's last message has
        ``finish_reason``, the call's last has ``usage``.  Closing early cancels the call."""
        request = chat_request(True, messages, parameters, params)
        return self._stream(request, timeout, self._stub.ChatStream)

    def health(self, *, timeout: float | None = None) -> None:
        """Return when the server can generate; raise UnavailableError otherwise.  Never
        retried: it is a probe."""
        try:
            self._stub.Health(pb.HealthRequest(), timeout=self._timeout_for(timeout))
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err

    def wait_ready(self, timeout: float = 60.0, poll_s: float = 0.25) -> None:
        """Poll :meth:`health` until the server can generate; UnavailableError after
        ``timeout`` seconds."""
        deadline = Deadline(timeout)
        while True:
            try:
                self.health(timeout=max(poll_s, 1.0))
                return
            except UnavailableError:
                remaining = deadline.remaining_s()
                if remaining is not None and remaining <= poll_s:
                    raise
            time.sleep(poll_s)

    def info(self, *, timeout: float | None = None) -> Any:
        """The model and every limit the server enforces (``pb.InfoResponse``)."""
        return self._unary(self._stub.Info, pb.InfoRequest(), timeout)

    def tokenize(
        self, text: str, *, add_special_tokens: bool | None = None, timeout: float | None = None
    ) -> list[Any]:
        """The tokens of ``text`` (``pb.SimpleToken``: id, text, [start, stop) char span)."""
        request = tokenize_request(text, add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout).tokens)

    def _timeout_for(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def _unary(self, method: Callable[..., Any], request: Any, timeout: float | None) -> Any:
        deadline = Deadline(self._timeout_for(timeout))
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=deadline.remaining_s(), metadata=self._metadata)
            except grpc.RpcError as err:
                code, _ = status_of(err)
                delay = self._retry.backoff_s(attempt)
                if not self._retry.should_retry(code, attempt, delay, deadline.remaining_s()):
                    raise error_from_rpc(err) from err
            time.sleep(delay)

    def _stream(
        self, request: Any, timeout: float | None, method: Callable[..., Any] | None = None
    ) -> Iterator[Any]:
        deadline = Deadline(self._timeout_for(timeout))
        attempt = 0
        while True:
            attempt += 1
            call = (method or self._stub.GenerateStream)(
                request, timeout=deadline.remaining_s(), metadata=self._metadata
            )
            started = False
            try:
                for msg in call:
                    started = True
                    yield msg
                return
            except grpc.RpcError as err:
                code, _ = status_of(err)
                delay = self._retry.backoff_s(attempt)
                if started or not self._retry.should_retry(
                    code, attempt, delay, deadline.remaining_s()
                ):
                    raise error_from_rpc(err) from err
            finally:
                # Frees the server's slot when the caller stops early; a no-op once done.
                call.cancel()
            time.sleep(delay)
