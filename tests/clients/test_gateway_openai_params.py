"""vLLM's extra sampling fields through genserve-gateway's OpenAI routes, sent by the real
`openai` package (`extra_body=` as vLLM documents it, `logit_bias=` as OpenAI has it), and
/v1/completions prompts given as token ids; answers are checked against the gRPC ones."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import openai
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.clients.conftest import DialectGateway

PROMPT = "Once upon a time"
EOS = 2  # <|im_end|>: the tokenizer's EOS, a special token
FORCE_EOS = {str(EOS): 100}  # OpenAI's logit_bias: string token ids


@pytest.fixture(scope="module")
def client(dialects: DialectGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=dialects.gateway.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def stub(dialects: DialectGateway) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(dialects.server.address) as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)


def grpc_result(stub: pb_grpc.TextGenerationServiceStub, **params: object) -> pb.GenerateResult:
    request = pb.GenerateRequest(
        inputs=[PROMPT],
        parameters=pb.GenerateParameters(details=True, **params),  # type: ignore[arg-type]
    )
    result: pb.GenerateResult = stub.Generate(request).results[0]
    return result


def test_logit_bias_ignore_eos_and_min_tokens(client: openai.OpenAI, model: str) -> None:
    ended = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=FORCE_EOS
    )
    assert ended.choices[0].finish_reason == "stop"
    assert ended.usage is not None and ended.usage.completion_tokens == 1
    kept_going = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias=FORCE_EOS,
        extra_body={"ignore_eos": True},
    )
    assert kept_going.choices[0].finish_reason == "length"
    assert kept_going.usage is not None and kept_going.usage.completion_tokens == 6
    assert kept_going.choices[0].text == ""  # EOS is special: skipped by default
    shown = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        logit_bias=FORCE_EOS,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert shown.choices[0].text == "<|im_end|>" * 3
    held = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias=FORCE_EOS,
        extra_body={"min_tokens": 3},
    )
    assert held.usage is not None and held.usage.completion_tokens == 4  # EOS 4th
    assert held.choices[0].finish_reason == "stop"


def test_stop_token_ids_and_include_stop_str(
    client: openai.OpenAI, model: str, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    full = grpc_result(stub, max_new_tokens=12)
    tokens = [t.id for t in full.details.tokens]
    stop_id = tokens[5]
    first = tokens.index(stop_id)
    texts = [t.text for t in full.details.tokens]
    for include in (False, True):
        out = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": include},
        )
        assert out.choices[0].finish_reason == "stop"
        assert out.usage is not None and out.usage.completion_tokens == first + 1
        kept = texts[: first + 1] if include else texts[:first]
        assert out.choices[0].text == "".join(kept)


def test_token_id_prompts_equal_text_prompts(
    client: openai.OpenAI, model: str, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    ids = [t.id for t in stub.Tokenize(pb.TokenizeRequest(inputs=PROMPT)).tokens]
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    batch = client.completions.create(
        model=model, prompt=[ids, ids[:2]], max_tokens=8, temperature=0
    )
    assert len(batch.choices) == 2 and batch.choices[0].text == text.choices[0].text
    streamed = client.completions.create(
        model=model, prompt=ids, max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text


def test_seeded_min_p_matches_grpc(
    client: openai.OpenAI, model: str, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, seed=11, extra_body={"min_p": 0.05}
    )
    # The gateway samples at OpenAI's default temperature 1 (do_sample, no temperature).
    expected = grpc_result(stub, max_new_tokens=10, do_sample=True, seed=11, min_p=0.05)
    assert out.choices[0].text == expected.generated_text


def test_chat_takes_the_extra_fields(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logit_bias=FORCE_EOS,
        extra_body={"min_tokens": 2},
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"logit_bias": {"4000000": 1}}, "outside the vocabulary"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"min_tokens": 20}}, "min_new_tokens"),
        ({"extra_body": {"stop_token_ids": [4000000]}}, "stop_token_ids"),
    ],
)
def test_bad_extra_fields_are_400(
    client: openai.OpenAI, model: str, kwargs: dict[str, object], needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=4, **kwargs)  # type: ignore[call-overload]
    assert needle in str(info.value)


def test_bad_token_prompts_are_400(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[5, 4000000], max_tokens=4)
    assert "outside the vocabulary" in str(info.value)
    # Issue #27: echo with a token-id prompt (lm-eval's scoring) sends back its decoding.
    from transformers import AutoTokenizer

    prompt_text = AutoTokenizer.from_pretrained(model).decode([504, 3575])
    echoed = client.completions.create(model=model, prompt=[504, 3575], max_tokens=1, echo=True)
    assert echoed.choices[0].text.startswith(prompt_text)
    assert len(echoed.choices[0].text) > len(prompt_text)


def test_proto_json_route_takes_the_fields(dialects: DialectGateway) -> None:
    """genserve's own JSON (grpc-gateway): the proto's names, map keys as strings."""
    body = {
        "input_ids": [{"ids": [504, 3575, 282]}],
        "parameters": {
            "max_new_tokens": 8,
            "logit_bias": {"100": 100, "200": 50},
            "stop_token_ids": [100],
            "min_new_tokens": 2,
            "details": True,
        },
    }
    status, reply = dialects.gateway.json("POST", "/v1/generate", body)
    assert status == 200, reply
    details = reply["results"][0]["details"]
    assert [t["id"] for t in details["tokens"]] == [200, 200, 100]
    assert details["stop_token_id"] == 100
    assert details["finish_reason"] == "FINISH_REASON_STOP_SEQUENCE"
