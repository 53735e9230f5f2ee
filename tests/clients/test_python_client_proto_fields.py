"""The Python client covers the proto: every ``GenerateParameters`` field is a keyword of
generate()/generate_stream(), and every other request field (``input_ids``) is one too.  The
first tests read the proto's descriptor, so they fail the day the proto gains a field the
client lacks; the last one sends ``n`` and ``input_ids`` to a real genserve."""

from __future__ import annotations

import inspect

from genserve.client import AsyncClient, Client
from genserve.client.params import CHAT_FIELDS, GenerateParams
from genserve.v1 import generate_pb2 as pb
from tests.utils.live_server import LiveServer

# Request fields every generate method takes under another name (the prompt itself and the
# message of keyword parameters).
_CARRIERS = {"inputs", "parameters"}


def _fields(message: type) -> set[str]:
    return {field.name for field in message.DESCRIPTOR.fields}


def test_every_generate_parameter_is_a_keyword() -> None:
    missing = _fields(pb.GenerateParameters) - set(GenerateParams.__annotations__)
    assert not missing, f"GenerateParams lacks proto field(s) {sorted(missing)}"


def test_every_request_field_is_an_argument() -> None:
    for request, method in (
        (pb.GenerateRequest, "generate"),
        (pb.GenerateStreamRequest, "generate_stream"),
    ):
        for client in (Client, AsyncClient):
            arguments = set(inspect.signature(getattr(client, method)).parameters)
            missing = _fields(request) - _CARRIERS - arguments
            assert not missing, f"{client.__name__}.{method} lacks {sorted(missing)}"


def test_every_chat_field_is_a_keyword() -> None:
    missing = _fields(pb.ChatRequest) - {"messages", "parameters"} - CHAT_FIELDS
    assert not missing, f"ChatParams lacks ChatRequest field(s) {sorted(missing)}"


def test_n_grammar_and_input_ids_reach_the_server(server: LiveServer) -> None:
    with Client(server.address, timeout=60) as client:
        ids = client.tokenize("Hello there")
        token_ids = [t.id for t in ids]
        by_text = client.generate("Hello there", max_new_tokens=5)
        by_ids = client.generate(input_ids=token_ids, max_new_tokens=5)
        # Token ids are used as they are; tokenize() shows what text becomes, so both agree.
        assert by_ids.generated_text == by_text.generated_text
        batch = client.generate(input_ids=[token_ids, token_ids[:1]], max_new_tokens=3)
        assert len(batch) == 2
        streamed = "".join(
            r.token.text
            for r in client.generate_stream(input_ids=token_ids, max_new_tokens=5)
            if not r.token.special
        )
        assert streamed == by_text.generated_text
        two = client.generate("Hello", n=2, do_sample=True, seed=5, max_new_tokens=4)
        assert isinstance(two, list) and len(two) == 2  # n results for the one prompt
        digits = client.generate("Hello", max_new_tokens=3, grammar={"regex": "[0-9]{3}"})
        assert digits.generated_text.isdigit() and len(digits.generated_text) == 3
