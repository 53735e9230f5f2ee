"""Requests that are not valid protobuf get ``INVALID_ARGUMENT``, not ``UNKNOWN``.

grpc.aio turns a deserializer that raises into ``UNKNOWN "Unexpected DecodeError"`` — a status
that reads like a server bug (the fuzz tests found it).  This interceptor makes the
deserializer of every unary-request method return an :class:`_Undecodable` marker instead of
raising, and the handler answer it with ``INVALID_ARGUMENT`` naming the expected message."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class _Undecodable:
    error: str


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or anything a deserializer raises on bad bytes
            return _Undecodable(str(exc) or type(exc).__name__)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, request: _Undecodable) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {request.error}"
    )


def _unary_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return handle


def _unary_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async for message in behavior(request, context):
                yield message

        return stream

    async def write(request: Any, context: grpc.aio.ServicerContext) -> Any:
        # Handlers that answer with context.write (grpc.health's Watch) are coroutines.
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        return await behavior(request, context)

    return write


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """INVALID_ARGUMENT for request bytes that do not parse (unary-request methods)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary_unary(handler.unary_unary),
                request_deserializer=deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_stream_rpc_method_handler(
            _unary_stream(handler.unary_stream),
            request_deserializer=deserializer,
            response_serializer=handler.response_serializer,
        )
