"""Every bad input gets a clear status; cancellations and errors leak no KV block."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.inproc_server import InProcessServer

LONG = " ".join(["word"] * 2000)


def _code(fn: object, *args: object, **kwargs: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args, **kwargs)  # type: ignore[operator]
    return info.value.code(), info.value.details()


def _gen(stub: pb_grpc.TextGenerationServiceStub, inputs: list[str], **params: object) -> object:
    return stub.Generate(
        pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(**params))  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"typical_p": 2.0}, "typical_p"),
        ({"repetition_penalty": -0.5}, "repetition_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        # OpenAI's and TGI's range is [-2, 2]: a negative penalty is valid, beyond 2 is not.
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"frequency_penalty": 2.1}, "frequency_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"top_n_tokens": 99}, "top_n_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 5000}, "max-total-tokens"),
        ({"truncate": 0}, "truncate"),
    ],
)
def test_invalid_parameters(
    stub: pb_grpc.TextGenerationServiceStub, params: dict[str, object], needle: str
) -> None:
    code, message = _code(_gen, stub, ["hello"], **params)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in message
    stream_req = pb.GenerateStreamRequest(
        inputs="hello", parameters=pb.GenerateParameters(**params)
    )  # type: ignore[arg-type]
    code, _ = _code(lambda: list(stub.GenerateStream(stream_req)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_prompt_too_long_names_both_numbers(stub: pb_grpc.TextGenerationServiceStub) -> None:
    code, message = _code(_gen, stub, [LONG], max_new_tokens=4)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert ("900" in message and "2001" in message) or "2000" in message
    # truncate makes the same prompt acceptable
    result = _gen(stub, [LONG], max_new_tokens=2, truncate=100, details=True)
    assert result.results[0].details.input_length == 100  # type: ignore[attr-defined]


def test_input_list_errors(stub: pb_grpc.TextGenerationServiceStub) -> None:
    assert _code(_gen, stub, [])[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(_gen, stub, [""])[0] == grpc.StatusCode.INVALID_ARGUMENT
    code, message = _code(_gen, stub, ["a"] * 5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max-client-batch-size" in message


def test_best_of_limits(stub: pb_grpc.TextGenerationServiceStub) -> None:
    # best_of and watermark are implemented (tests/e2e/test_best_of.py, test_watermark.py).
    assert _code(_gen, stub, ["hi"], best_of=2)[0] == grpc.StatusCode.INVALID_ARGUMENT  # greedy
    assert _code(_gen, stub, ["hi"], best_of=3)[0] == grpc.StatusCode.INVALID_ARGUMENT


def _wait_all_blocks_free(server: InProcessServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.num_free_blocks() == server.num_total_blocks():
            return
        time.sleep(0.05)
    raise AssertionError(
        f"{server.num_total_blocks() - server.num_free_blocks()} KV blocks still in use"
    )


def test_cancel_and_deadline_free_blocks(
    server: InProcessServer, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    _wait_all_blocks_free(server)
    params = pb.GenerateParameters(max_new_tokens=120)
    # A stream cancelled by the client after a few tokens.
    call = stub.GenerateStream(
        pb.GenerateStreamRequest(inputs="tell me a story", parameters=params)
    )
    for i, _ in enumerate(call):
        if i == 3:
            call.cancel()
            break
    # Calls whose deadline passes mid-generation.
    for _ in range(3):
        code, _ = _code(
            stub.Generate,
            pb.GenerateRequest(inputs=["a long story " * 20], parameters=params),
            timeout=0.05,
        )
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # Errors mixed in.
    _code(_gen, stub, [LONG])
    _wait_all_blocks_free(server)
    assert server.call(lambda: server.engine.num_in_flight) == 0
    # And the server still answers.
    assert _gen(stub, ["still alive?"], max_new_tokens=3).results[0].generated_text is not None  # type: ignore[attr-defined]


def test_overload_is_resource_exhausted(tiny_llama: object) -> None:
    from tests.utils.inproc_server import inproc_server

    with (
        inproc_server(
            tiny_llama,  # type: ignore[arg-type]
            "--dtype",
            "float32",
            "--max-concurrent-requests",
            "2",
            "--max-total-tokens",
            "600",
            "--max-batch-total-tokens",
            "4096",
            "--prometheus-port",
            "0",
        ) as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        params = pb.GenerateParameters(max_new_tokens=500)
        streams = [
            stub.GenerateStream(pb.GenerateStreamRequest(inputs="go on", parameters=params))
            for _ in range(2)
        ]
        for s in streams:
            next(s)  # both are in flight now
        code, message = _code(_gen, stub, ["one more"], max_new_tokens=2)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max-concurrent-requests" in message
        for s in streams:
            s.cancel()
        _wait_all_blocks_free(srv)
        # Capacity is back once the streams are gone.
        assert _gen(stub, ["now"], max_new_tokens=2).results[0] is not None  # type: ignore[attr-defined]


def test_concurrent_cancellations_under_load(
    server: InProcessServer, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    params = pb.GenerateParameters(max_new_tokens=60)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            call = stub.GenerateStream(
                pb.GenerateStreamRequest(inputs=f"request {i} " * (i + 1), parameters=params)
            )
            for j, _ in enumerate(call):
                if j == i % 7:
                    call.cancel()
                    break
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    _wait_all_blocks_free(server)
