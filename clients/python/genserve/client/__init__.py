"""Thin Python client for genserve: ``Client`` (blocking) and ``AsyncClient`` (asyncio).

Requests and responses are the generated protobuf messages of ``genserve.v1``; failures raise
:class:`GenserveError` subclasses carrying the gRPC status code and message."""

from genserve.client.aio import AsyncClient
from genserve.client.auth import api_key_metadata, tls_credentials
from genserve.client.errors import (
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    GenserveError,
    InvalidArgumentError,
    NotFoundError,
    OverloadedError,
    UnavailableError,
    UnimplementedError,
    error_from_rpc,
)
from genserve.client.params import ChatParams, GenerateParams, build_parameters
from genserve.client.retry import NO_RETRY, RetryPolicy
from genserve.client.sync import Client

__all__ = [
    "NO_RETRY",
    "AsyncClient",
    "CancelledError",
    "ChatParams",
    "Client",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "GenerateParams",
    "GenserveError",
    "InvalidArgumentError",
    "NotFoundError",
    "OverloadedError",
    "RetryPolicy",
    "UnavailableError",
    "UnimplementedError",
    "api_key_metadata",
    "build_parameters",
    "error_from_rpc",
    "tls_credentials",
]
