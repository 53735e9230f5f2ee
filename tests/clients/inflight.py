"""Holding a request in flight on a real server, to provoke RESOURCE_EXHAUSTED for real."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc


@contextmanager
def request_in_flight(address: str) -> Iterator[None]:
    """A GenerateStream as long as the server allows, started and seen to produce a token
    before the block runs; cancelled (its slot freed) when the block ends."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest(), timeout=30)
        prompt = "hold"
        num_prompt_tokens = len(stub.Tokenize(pb.TokenizeRequest(inputs=prompt)).tokens)
        params = pb.GenerateParameters(max_new_tokens=info.max_total_tokens - num_prompt_tokens - 1)
        call = stub.GenerateStream(pb.GenerateStreamRequest(inputs=prompt, parameters=params))
        try:
            next(call)  # the request is admitted and generating
            yield
        finally:
            call.cancel()
    wait_until_admitted(address)


def wait_until_admitted(address: str, timeout_s: float = 30.0) -> None:
    """Until a one-token Generate is admitted again (cancellation frees slots at the next
    engine step, not at once)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        request = pb.GenerateRequest(
            inputs=["x"], parameters=pb.GenerateParameters(max_new_tokens=1)
        )
        while True:
            try:
                stub.Generate(request, timeout=30)
                return
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
