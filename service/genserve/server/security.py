"""Who may talk to the server and over what: the API-key interceptor, TLS / mutual-TLS server
credentials, and the transport limits (message size, keepalive enforcement, connection age).

The API key follows SGLang's ``--api-key``: every RPC needs ``authorization: Bearer <key>``
metadata, compared in constant time (``hmac.compare_digest``); a missing or wrong key gets
``UNAUTHENTICATED`` before the request message is even parsed.  Services in
``--api-key-exempt`` (by default grpc.health.v1 and both reflection versions) answer without
it: kubelet probes, grpc_health_probe and mesh sidecars send no credentials, and reflection
serves only the public schema.  The key itself is never logged."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from genserve.config import Config

_BEARER = "bearer "


class SecurityConfigError(OSError):
    """TLS flags that do not fit together or files that cannot be read.  An OSError, so the
    launcher reports it as it reports a port it cannot bind: one line, exit code 2."""


def _service_of(method: str) -> str:
    """``/genserve.v1.TextGenerationService/Generate`` → ``genserve.v1.TextGenerationService``."""
    return method.lstrip("/").split("/", 1)[0]


def _bearer_token(metadata: tuple[tuple[str, str | bytes], ...] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            if text[: len(_BEARER)].lower() == _BEARER:
                return text[len(_BEARER) :].strip().encode()
            return None
    return None


def _denied_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED.  Requests
    stay raw bytes: nothing a caller without the key sends is parsed."""

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, response_serializer=serializer)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, response_serializer=serializer)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, response_serializer=serializer)
    return grpc.unary_unary_rpc_method_handler(deny, response_serializer=serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """``UNAUTHENTICATED`` unless the call carries ``authorization: Bearer <api_key>`` or
    belongs to one of the ``exempt`` services."""

    def __init__(self, api_key: str, exempt: tuple[str, ...]) -> None:
        if not api_key:
            raise ValueError("the API key is empty")
        self._key = api_key.encode()
        self._exempt = frozenset(exempt)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or _service_of(method) in self._exempt:
            return handler
        token = _bearer_token(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        if token is None:
            return _denied_handler(handler, "missing 'authorization: Bearer <api key>' metadata")
        # compare_digest: the time taken does not reveal how much of the key matched.
        if not hmac.compare_digest(token, self._key):
            return _denied_handler(handler, "invalid API key")
        return handler


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SecurityConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """TLS credentials from the --tls-* flags, or None for plaintext.  With
    --tls-client-ca-file every client must present a certificate signed by that CA."""
    cert, key, client_ca = config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file
    if cert is None and key is None:
        if client_ca is not None:
            raise SecurityConfigError(
                "--tls-client-ca-file needs --tls-cert-file and --tls-key-file"
            )
        return None
    if cert is None or key is None:
        raise SecurityConfigError("--tls-cert-file and --tls-key-file go together")
    chain = _read(cert, "--tls-cert-file")
    private_key = _read(key, "--tls-key-file")
    roots = _read(client_ca, "--tls-client-ca-file") if client_ca is not None else None
    return grpc.ssl_server_credentials(
        [(private_key, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def server_options(config: Config) -> list[tuple[str, int]]:
    """grpc core channel arguments: message size limits and keepalive enforcement.

    ``keepalive_permit_without_calls = 0`` and ``http2.min_ping_interval_without_data_ms``:
    a client pinging faster than allowed, or pinging a connection with no call, collects
    strikes and gets GOAWAY(too_many_pings) after ``http2.max_ping_strikes`` — so a swarm of
    idle, pinging connections cannot pin server resources.  ``max_connection_idle`` closes
    connections without calls; ``max_connection_age`` (off by default) makes long-lived
    clients reconnect, which spreads them over replicas behind an L4 balancer."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_size),
        ("grpc.max_send_message_length", config.max_message_size),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(config.keepalive_min_ping_interval)),
        (
            "grpc.http2.min_recv_ping_interval_without_data_ms",
            _ms(config.keepalive_min_ping_interval),
        ),
        ("grpc.http2.max_ping_strikes", 2),
    ]
    if config.max_connection_idle > 0:
        options.append(("grpc.max_connection_idle_ms", _ms(config.max_connection_idle)))
    if config.max_connection_age > 0:
        options.append(("grpc.max_connection_age_ms", _ms(config.max_connection_age)))
        options.append(("grpc.max_connection_age_grace_ms", _ms(config.max_connection_age_grace)))
    return options


def security_interceptors(config: Config) -> list[grpc.aio.ServerInterceptor]:
    """The API-key interceptor when --api-key is set (first, so rejected calls cost nothing)."""
    if config.api_key is None:
        return []
    return [ApiKeyInterceptor(config.api_key, config.api_key_exempt)]
