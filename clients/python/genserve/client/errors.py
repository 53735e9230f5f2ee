"""Typed exceptions: every failed call raises a :class:`GenserveError` subclass that carries the
gRPC status code and the server's message, so callers can ``except OverloadedError`` instead of
comparing status codes."""

from __future__ import annotations

import grpc


class GenserveError(Exception):
    """A call to genserve failed.  ``code`` is the gRPC status, ``message`` the server's text."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidArgumentError(GenserveError):
    """INVALID_ARGUMENT: the request broke a limit or rule; the message says which."""


class OverloadedError(GenserveError):
    """RESOURCE_EXHAUSTED: the server is at max_concurrent_requests; try again later."""


class UnavailableError(GenserveError):
    """UNAVAILABLE: the server is loading, shutting down, or cannot be reached."""


class DeadlineExceededError(GenserveError):
    """DEADLINE_EXCEEDED: the call's timeout passed before it finished."""


class CancelledError(GenserveError):
    """CANCELLED: the call was cancelled."""


class UnimplementedError(GenserveError):
    """UNIMPLEMENTED: the server does not (yet) support what was asked, e.g. best_of."""


class FailedPreconditionError(GenserveError):
    """FAILED_PRECONDITION: the server is not set up for the call, e.g. Chat on a model
    without a chat template (the message names the flag that fixes it)."""


class NotFoundError(GenserveError):
    """NOT_FOUND: e.g. Chat naming a ``model`` the server does not serve."""


_BY_CODE: dict[grpc.StatusCode, type[GenserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
}


# gRPC C-core (so genserve's Python server) ends a call that reached a server after its shutdown
# began, before any handler took it, with CANCELLED and the bare message "CANCELLED"
# (grpc/grpc#41785; the fix in grpc/grpc#41786 sends UNAVAILABLE).  A client that talks to the
# server directly never sees it: the server's GOAWAY makes gRPC retry such calls itself.  Behind
# a proxy with pooled upstream connections (nginx, a mesh sidecar) it reaches the caller.  The
# call never ran, so it means what UNAVAILABLE means.  A call the caller cancels itself carries
# gRPC's local message ("Locally cancelled by application!"), and genserve's own CANCELLED says
# "cancelled by the client", so neither is taken for it.
_SHUTDOWN_CANCEL_MESSAGE = "CANCELLED"
_SHUTDOWN_CANCEL_AS = "server shut down before the call started (gRPC sent CANCELLED: CANCELLED)"


def status_of(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a failed call (sync or asyncio); the CANCELLED that gRPC's
    server sends for a call that arrived as it shut down is reported as UNAVAILABLE."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or ""
    if code is grpc.StatusCode.CANCELLED and details == _SHUTDOWN_CANCEL_MESSAGE:
        return grpc.StatusCode.UNAVAILABLE, _SHUTDOWN_CANCEL_AS
    return code, details


def error_from_rpc(err: grpc.RpcError) -> GenserveError:
    """The typed exception for a failed call; unknown codes give a plain GenserveError."""
    code, message = status_of(err)
    return _BY_CODE.get(code, GenserveError)(code, message)
