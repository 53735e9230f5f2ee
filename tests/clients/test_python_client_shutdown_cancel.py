"""The Python client and the CANCELLED that gRPC's C-core server sends for a call that reached it
as it shut down (grpc/grpc#41785): behind a proxy such as nginx that call reaches the caller, it
never ran, and the client must treat it as UNAVAILABLE (retry it) and nothing else that way.

The server here is a real gRPC server speaking genserve's protocol that answers its first calls
with exactly that status (CANCELLED, message "CANCELLED"); tests/deploy/test_proxy.py meets the
real thing through nginx when a replica stops."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from genserve.client import (
    NO_RETRY,
    AsyncClient,
    CancelledError,
    Client,
    RetryPolicy,
    UnavailableError,
)
from genserve.client.errors import status_of
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc

FAST_RETRY = RetryPolicy(max_attempts=5, initial_backoff_s=0.01, max_backoff_s=0.05)


class _CancelFirst(pb_grpc.TextGenerationServiceServicer):  # type: ignore[misc]
    """Ends the first ``failures`` calls with CANCELLED and ``message``, then generates "ok"."""

    def __init__(self, failures: int, message: str) -> None:
        self.failures = failures
        self.message = message
        self.calls = 0
        self._lock = threading.Lock()

    def _fail_now(self) -> bool:
        with self._lock:
            self.calls += 1
            return self.calls <= self.failures

    def Generate(self, request: Any, context: grpc.ServicerContext) -> Any:
        if self._fail_now():
            context.abort(grpc.StatusCode.CANCELLED, self.message)
        return pb.GenerateResponse(results=[pb.GenerateResult(generated_text="ok")])

    def GenerateStream(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        if self._fail_now():
            context.abort(grpc.StatusCode.CANCELLED, self.message)
        yield pb.GenerateStreamResponse(index=0, generated_text="ok")


def _serve(servicer: _CancelFirst) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_TextGenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def shutdown_cancel() -> Iterator[tuple[_CancelFirst, str]]:
    servicer = _CancelFirst(failures=2, message="CANCELLED")
    server, address = _serve(servicer)
    yield servicer, address
    server.stop(0)


def test_sync_client_retries_the_shutdown_cancel(shutdown_cancel: tuple[_CancelFirst, str]) -> None:
    servicer, address = shutdown_cancel
    with Client(address, timeout=10, retry=FAST_RETRY) as client:
        assert client.generate("Hi").generated_text == "ok"
        assert servicer.calls == 3
        servicer.calls = 0
        assert [m.generated_text for m in client.generate_stream("Hi")] == ["ok"]
        assert servicer.calls == 3


def test_async_client_retries_the_shutdown_cancel(
    shutdown_cancel: tuple[_CancelFirst, str],
) -> None:
    servicer, address = shutdown_cancel

    async def run() -> None:
        async with AsyncClient(address, timeout=10, retry=FAST_RETRY) as client:
            assert (await client.generate("Hi")).generated_text == "ok"
            servicer.calls = 0
            assert [m.generated_text async for m in client.generate_stream("Hi")] == ["ok"]

    asyncio.run(run())
    assert servicer.calls == 3


def test_without_retries_it_is_an_unavailable_error(
    shutdown_cancel: tuple[_CancelFirst, str],
) -> None:
    _, address = shutdown_cancel
    with (
        Client(address, timeout=10, retry=NO_RETRY) as client,
        pytest.raises(UnavailableError) as exc,
    ):
        client.generate("Hi")
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE
    assert "shut down" in exc.value.message


def test_other_cancellations_are_not_retried() -> None:
    """A CANCELLED with any other message (genserve's own says "cancelled by the client") stays
    CANCELLED and is not retried."""
    servicer = _CancelFirst(failures=1, message="cancelled by the client")
    server, address = _serve(servicer)
    try:
        with Client(address, timeout=10, retry=FAST_RETRY) as client, pytest.raises(CancelledError):
            client.generate("Hi")
        assert servicer.calls == 1
    finally:
        server.stop(0)


def test_a_call_the_caller_cancels_stays_cancelled(
    shutdown_cancel: tuple[_CancelFirst, str],
) -> None:
    servicer, address = shutdown_cancel
    servicer.failures = 0
    with grpc.insecure_channel(address) as channel:
        call = pb_grpc.TextGenerationServiceStub(channel).GenerateStream(
            pb.GenerateStreamRequest(inputs="Hi"), timeout=10
        )
        call.cancel()
        with pytest.raises(grpc.RpcError) as exc:
            list(call)
    code, message = status_of(exc.value)
    assert code == grpc.StatusCode.CANCELLED, message
