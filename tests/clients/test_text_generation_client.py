"""TGI's own Python client, ``text-generation`` 0.7, unchanged against genserve-gateway: its
``generate``, ``generate_stream`` and unary ``chat`` (which validates every response with
pydantic: a null ``system_fingerprint`` used to fail it) give what genserve gives over gRPC.

The package pins ``huggingface-hub<1.0``, which the dev extra's huggingface_hub contradicts,
so ``scripts/bootstrap.sh`` installs it without its dependencies (it needs only requests,
aiohttp and pydantic at run time)."""

from __future__ import annotations

import pytest

from genserve.client import Client as GrpcClient
from tests.clients.conftest import DialectGateway

text_generation = pytest.importorskip(
    "text_generation", reason="text-generation is installed by scripts/bootstrap.sh (--no-deps)"
)

PROMPT = "Once upon a time"


def test_generate_and_stream_equal_grpc(dialects: DialectGateway) -> None:
    with GrpcClient(dialects.server.address, timeout=60) as grpc_client:
        expected = grpc_client.generate(PROMPT, max_new_tokens=8).generated_text
    tgi = text_generation.Client(dialects.gateway.url, timeout=60)
    response = tgi.generate(PROMPT, max_new_tokens=8)  # always asks for details
    assert response.generated_text == expected
    assert response.details.generated_tokens == len(response.details.tokens) == 8
    assert response.details.finish_reason.value == "length"
    streamed = list(tgi.generate_stream(PROMPT, max_new_tokens=8))
    assert "".join(r.token.text for r in streamed if not r.token.special) == expected
    assert streamed[-1].generated_text == expected
    assert streamed[-1].details is not None and streamed[-1].details.generated_tokens == 8


def test_chat_parses(dialects: DialectGateway) -> None:
    tgi = text_generation.Client(dialects.gateway.url, timeout=60)
    messages = [
        text_generation.types.Message(role="user", content="What is the capital of France?")
    ]
    reply = tgi.chat(messages=messages, max_tokens=8, temperature=0.0, seed=1)
    assert reply.system_fingerprint  # a string: pydantic refused null here before
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage["completion_tokens"] <= 8
    # Not tested: its streamed chat. text-generation 0.7's ChatCompletionChunk declares
    # ``delta.tool_calls`` Optional without a default, which pydantic 2 makes required; TGI's
    # own router does not send it on text deltas either, so the package fails against TGI too.
