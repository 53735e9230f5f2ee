"""Why a request cannot become engine requests, and the gRPC status that answers each reason.

Every refusal of the conversion is a :class:`RequestError` subclass carrying its status, so
the servicer maps all of them with one ``except`` and the mapping lives here, beside the
reasons.  Messages follow TGI's router where TGI has one."""

from __future__ import annotations

from typing import ClassVar

import grpc


class RequestError(ValueError):
    """A request the server refuses before it reaches the engine."""

    status: ClassVar[grpc.StatusCode] = grpc.StatusCode.INVALID_ARGUMENT


class ValidationError(RequestError):
    """Bad input: answered with INVALID_ARGUMENT."""


class UnsupportedError(RequestError):
    """A valid request for something this server does not do: answered with UNIMPLEMENTED."""

    status = grpc.StatusCode.UNIMPLEMENTED


class GrammarUnsupportedError(UnsupportedError):
    """Grammar support is off (--disable-grammar-support): answered with UNIMPLEMENTED,
    because the request is well formed and this server instance was told not to serve it."""


class ModelNotFoundError(RequestError):
    """The request names a model this server does not serve: NOT_FOUND (as vLLM's 404)."""

    status = grpc.StatusCode.NOT_FOUND


class NoTemplateError(RequestError):
    """FAILED_PRECONDITION: the server has no chat template."""

    status = grpc.StatusCode.FAILED_PRECONDITION
