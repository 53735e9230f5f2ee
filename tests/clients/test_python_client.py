"""The Python client (genserve.client) against real genserve processes."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing
from pathlib import Path

import grpc
import pytest

from genserve.client import (
    NO_RETRY,
    AsyncClient,
    Client,
    GenserveError,
    InvalidArgumentError,
    OverloadedError,
    RetryPolicy,
    UnavailableError,
)
from genserve.v1 import generate_pb2 as pb
from tests.clients.conftest import MAX_CLIENT_BATCH_SIZE, SERVER_ARGS
from tests.clients.inflight import request_in_flight
from tests.utils.live_server import LiveServer, free_port, start_server

PROMPTS = ["Hello there", "The capital of France is", "1 2 3"]


def test_generate_one_and_a_batch_in_order(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        alone = [client.generate(p, max_new_tokens=5, details=True) for p in PROMPTS]
        batch = client.generate(PROMPTS, max_new_tokens=5, details=True)
    assert isinstance(alone[0], pb.GenerateResult)
    assert len(batch) == len(PROMPTS)
    # Greedy decoding is deterministic: in a batch, each input gets what it gets alone.
    assert [r.generated_text for r in batch] == [r.generated_text for r in alone]
    for result in batch:
        assert 1 <= result.details.generated_tokens <= 5
        assert result.details.finish_reason in (
            pb.FINISH_REASON_LENGTH,
            pb.FINISH_REASON_EOS_TOKEN,
        )


def test_parameters_message_and_keywords_combine(server: LiveServer) -> None:
    base = pb.GenerateParameters(max_new_tokens=50, details=True)
    with Client(server.address, timeout=60) as client:
        result = client.generate("Hello", parameters=base, max_new_tokens=2)
    assert result.details.generated_tokens <= 2  # the keyword overrides the message
    assert base.max_new_tokens == 50  # and the caller's message is not modified


def test_stream_concatenates_to_the_unary_result(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        unary = client.generate("Once upon a time", max_new_tokens=8).generated_text
        messages = list(client.generate_stream("Once upon a time", max_new_tokens=8))
    assert [m.index for m in messages] == list(range(len(messages)))
    assert "".join(m.token.text for m in messages) == unary
    last = messages[-1]
    assert last.HasField("generated_text") and last.generated_text == unary
    assert last.details.generated_tokens == len(messages)
    assert not any(m.HasField("generated_text") for m in messages[:-1])


def test_health_info_tokenize(server: LiveServer) -> None:
    with Client(server.address, timeout=30) as client:
        client.health()
        client.wait_ready(timeout=5)
        info = client.info()
        tokens = client.tokenize("Hello world")
        plain = client.tokenize("Hello world", add_special_tokens=False)
    assert info.max_client_batch_size == MAX_CLIENT_BATCH_SIZE
    assert info.max_total_tokens > info.max_input_tokens > 0
    assert info.num_kv_blocks > 0 and info.version
    assert tokens and all(0 <= t.start <= t.stop <= len("Hello world") for t in tokens)
    assert len(plain) <= len(tokens)


def test_bad_input_raises_typed_errors(server: LiveServer) -> None:
    with Client(server.address, timeout=30) as client:
        with pytest.raises(InvalidArgumentError) as too_many:
            client.generate(["a"] * (MAX_CLIENT_BATCH_SIZE + 1), max_new_tokens=1)
        with pytest.raises(InvalidArgumentError) as top_p:
            client.generate("x", top_p=1.5)
        with pytest.raises(InvalidArgumentError):
            list(client.generate_stream("x", top_p=1.5))
        with pytest.raises(TypeError, match="max_tokens"):
            client.generate("x", max_tokens=3)  # type: ignore[call-overload]
    for err in (too_many.value, top_p.value):
        assert isinstance(err, GenserveError)
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.message  # a message a person can act on
    assert str(MAX_CLIENT_BATCH_SIZE) in too_many.value.message


def test_leaving_a_stream_early_cancels_it(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        for _msg in client.generate_stream("Count with me", max_new_tokens=200):
            break
        # The server carries on (and the cancelled request left the batch).
        assert client.generate("still serving", max_new_tokens=2).details is not None


def test_async_client(server: LiveServer) -> None:
    async def main() -> None:
        async with AsyncClient(server.address, timeout=60) as client:
            await client.health()
            info = await client.info()
            assert info.max_client_batch_size == MAX_CLIENT_BATCH_SIZE
            results = await asyncio.gather(*(client.generate(p, max_new_tokens=5) for p in PROMPTS))
            batch = await client.generate(PROMPTS, max_new_tokens=5)
            assert [r.generated_text for r in results] == [r.generated_text for r in batch]

            texts = []
            async with aclosing(client.generate_stream(PROMPTS[1], max_new_tokens=5)) as stream:
                async for msg in stream:
                    texts.append(msg.token.text)
            assert "".join(texts) == results[1].generated_text
            assert await client.tokenize("Hello")
            with pytest.raises(InvalidArgumentError):
                await client.generate("x", top_k=-1)
            with pytest.raises(InvalidArgumentError):
                async for _ in client.generate_stream("x", temperature=0.0, do_sample=True):
                    pass

    asyncio.run(main())


def test_overload_raises_overloaded_error(busy_server: LiveServer) -> None:
    with (
        Client(busy_server.address, timeout=30) as client,
        request_in_flight(busy_server.address),
        pytest.raises(OverloadedError) as exc,
    ):
        client.generate("one too many", max_new_tokens=1)
    assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_unavailable_without_retries_fails_fast() -> None:
    port = free_port()  # nothing listens there
    with Client(f"127.0.0.1:{port}", timeout=10, retry=NO_RETRY) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.info()
        assert time.monotonic() - start < 5
        with pytest.raises(UnavailableError):
            client.health()


def test_retries_stop_at_max_attempts() -> None:
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.2, multiplier=2.0, jitter=0.0)
    with Client(f"127.0.0.1:{free_port()}", timeout=30, retry=policy) as client:
        start = time.monotonic()
        with pytest.raises(UnavailableError):
            client.info()
        elapsed = time.monotonic() - start
    assert 0.6 <= elapsed < 10  # waited 0.2 s then 0.4 s between the three attempts


def test_calls_retry_until_the_server_is_up(tiny_model: Path) -> None:
    """A call made before the server listens, then while it loads, succeeds once it serves."""
    port = free_port()
    policy = RetryPolicy(max_attempts=1000, initial_backoff_s=0.05, max_backoff_s=0.5)
    outcome: dict[str, object] = {}

    def call() -> None:
        with Client(f"127.0.0.1:{port}", timeout=240, retry=policy) as client:
            try:
                outcome["text"] = client.generate("Hello", max_new_tokens=3).generated_text
            except GenserveError as err:
                outcome["error"] = err

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)  # the first attempts find nothing listening
    with start_server(tiny_model, *SERVER_ARGS, port=port):
        caller.join(timeout=240)
    assert not caller.is_alive()
    assert "error" not in outcome, outcome.get("error")
    assert isinstance(outcome["text"], str)
