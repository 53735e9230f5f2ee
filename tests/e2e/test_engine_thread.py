"""The engine loop does not wait on the gRPC event loop (issue #29): a real server, real gRPC.

The engine loop runs on a thread of its own.  With a stream generating, the server's gRPC
event loop (the loop running the servicer) is blocked, as a slow servicer or a burst of
serialisation would block it, until the engine has applied ``STEPS`` more steps (or
``MAX_BLOCK_S`` has passed: with the engine loop on the gRPC loop, as before, no step
result could be applied meanwhile and the block would always time out).  Once the loop is
free again the outputs piled up for it arrive complete and in order: the same tokens as an
undisturbed run, and no KV block is left in use."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.inproc_server import inproc_server

STEPS = 5
MAX_BLOCK_S = 20.0
MAX_NEW_TOKENS = 64  # > STEPS + 1: the stream is still generating when the block ends


def test_engine_keeps_stepping_while_the_grpc_loop_is_blocked(tiny_llama: Path) -> None:
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, ignore_eos=True, details=True)
    prompt = "The engine thread keeps stepping"
    with inproc_server(tiny_llama, *PARITY_SERVER_ARGS) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            reference = stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params))
            expected = [t.id for t in reference.results[0].details.tokens]
            assert len(expected) == MAX_NEW_TOKENS

            window: dict[str, float] = {}
            blocked = threading.Event()

            def block_the_grpc_loop() -> None:  # runs on the server's gRPC loop
                start, started = server.engine.num_steps, time.monotonic()
                blocked.set()
                while server.engine.num_steps - start < STEPS:
                    if time.monotonic() - started > MAX_BLOCK_S:
                        break
                    time.sleep(0.002)  # the loop stays blocked: nothing else runs on it
                window["steps"] = server.engine.num_steps - start
                window["blocked_s"] = time.monotonic() - started

            stream = stub.GenerateStream(pb.GenerateStreamRequest(inputs=prompt, parameters=params))
            messages = [next(stream)]  # the request is in the batch: the engine is stepping
            server._loop.call_soon_threadsafe(block_the_grpc_loop)
            assert blocked.wait(30)
            messages.extend(stream)
        server.wait_all_blocks_free()

    assert window["steps"] >= STEPS, window
    assert [m.index for m in messages] == list(range(MAX_NEW_TOKENS))
    assert [m.token.id for m in messages] == expected
    assert messages[-1].details.generated_tokens == MAX_NEW_TOKENS
