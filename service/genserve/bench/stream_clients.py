"""The benchmarks' streaming clients: one request of ``new_tokens`` greedy tokens (end of
sequence ignored) to genserve over gRPC or to llama.cpp's ``llama-server`` over HTTP, returning
the time each token arrived (``time.perf_counter``), for the server comparison
(``server_compare``) and the start-up benchmark (``gguf_start``)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

import grpc
import httpx

from genserve.v1 import generate_pb2, generate_pb2_grpc

# ids and new tokens -> each token's arrival time
Client = Callable[[list[int], int], Awaitable[list[float]]]


# ---------------------------------------------------------------------------- genserve
async def _genserve_stream(
    stub: generate_pb2_grpc.TextGenerationServiceStub, ids: list[int], new_tokens: int
) -> list[float]:
    params = generate_pb2.GenerateParameters(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True
    )
    request = generate_pb2.GenerateStreamRequest(input_ids=ids, parameters=params)
    times: list[float] = []
    async for _message in stub.GenerateStream(request, timeout=3600):  # one token each
        times.append(time.perf_counter())
    return times


def genserve_client(address: str) -> Client:
    """Streaming ``GenerateStream`` requests on one channel: each returns its tokens'
    arrival times."""
    channel = grpc.aio.insecure_channel(address)
    stub = generate_pb2_grpc.TextGenerationServiceStub(channel)

    async def one(ids: list[int], new_tokens: int) -> list[float]:
        return await _genserve_stream(stub, ids, new_tokens)

    return one


# ---------------------------------------------------------------------------- llama.cpp
def llama_client(url: str) -> Client:
    """Streaming ``/completion`` requests, one TCP connection each: each returns its tokens'
    arrival times.

    Not pooled, because llama-server closes the connection after every *streamed* reply
    although the reply says ``Keep-Alive``: its content provider ends the stream by
    returning false, which cpp-httplib takes for a cancelled write and so drops the socket
    right after the terminating chunk.  A pooled client may send its next request on that
    socket before the server's FIN arrives, and gets "Server disconnected without sending a
    response"; the run then failed and stopped the server (whose log reads "cleaning up
    before exit": our SIGTERM).  ``Connection: close`` makes both sides agree that every
    connection carries one request.
    """
    client = httpx.AsyncClient(timeout=3600, headers={"Connection": "close"})

    async def one(ids: list[int], new_tokens: int) -> list[float]:
        body = {
            "prompt": ids,
            "n_predict": new_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "stream": True,
            "return_tokens": True,
        }
        times: list[float] = []
        async with client.stream("POST", f"{url}/completion", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                n = len(event.get("tokens") or []) or (1 if event.get("content") else 0)
                now = time.perf_counter()
                times.extend([now] * n)
        return times

    return one
