"""Issue #27: one test per OpenAI / TGI divergence fixed on genserve-gateway, with the real
client libraries, and the exact request shapes lm-evaluation-harness's `local-completions`
sends (the shapes below are those of lm_eval 0.4.9's `LocalCompletionsAPI._create_payload` and
`parse_logprobs`, and of later versions' `max_tokens: 0`), scored against transformers on the
same weights in float32.  lm-eval itself runs in tests/clients/test_lm_eval.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import torch
from huggingface_hub import InferenceClient

from genserve.client import Client
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.clients.conftest import DialectGateway
from tests.clients.gateway_process import Gateway

MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story."}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(dialects: DialectGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=dialects.gateway.url + "/v1", api_key="unused", max_retries=0)


def test_developer_role_is_system(client: openai.OpenAI) -> None:
    def reply(role: str) -> str:
        out = client.chat.completions.create(
            model="",
            messages=[{"role": role, "content": "Answer briefly."}, *MESSAGES],  # type: ignore[misc]
            max_tokens=8,
            temperature=0,
        )
        return out.choices[0].message.content or ""

    assert reply("developer") == reply("system")


def test_top_logprobs_twenty_and_fingerprint(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=20
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 20 for t in content)
    assert out.system_fingerprint and out.system_fingerprint.startswith("fp_")
    chunks = list(
        client.chat.completions.create(
            model="", messages=MESSAGES, max_tokens=3, temperature=0, stream=True
        )
    )
    assert {c.system_fingerprint for c in chunks} == {out.system_fingerprint}


def test_frequency_penalty_has_openai_semantics(
    client: openai.OpenAI, dialects: DialectGateway
) -> None:
    """The gateway's frequency_penalty is the server's output_frequency_penalty (penalty x
    count over the output), not TGI's frequency_penalty (count / length over everything)."""
    prompt = "hello hello hello hello hello hello"
    out = client.completions.create(
        model="", prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=2.0
    )

    def grpc(**penalty: float) -> str:
        with Client(dialects.server.address, timeout=60) as c:
            return str(c.generate(prompt, max_new_tokens=12, **penalty).generated_text)

    assert out.choices[0].text == grpc(output_frequency_penalty=2.0)
    assert out.choices[0].text != grpc() or out.choices[0].text == grpc(frequency_penalty=2.0)


def test_suffix_refused_without_fim_tokens(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        client.completions.create(model="", prompt="def f(", suffix="    return x", max_tokens=4)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json", "value": SCHEMA},  # TGI's and huggingface_hub's documented shape
        {"type": "json_object", "value": SCHEMA},  # what huggingface_hub sends
        # OpenAI's shape, which huggingface_hub rewrites to json_object + value
        {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
    ],
)
def test_huggingface_hub_response_formats_are_honoured(
    dialects: DialectGateway, response_format: dict[str, Any]
) -> None:
    hf = InferenceClient(base_url=dialects.gateway.url)
    out = hf.chat_completion(
        MESSAGES,
        response_format=response_format,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), SCHEMA)


def test_unknown_response_format_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model="",
            messages=MESSAGES,
            response_format={"type": "grammar", "value": "root ::= x"},  # type: ignore[arg-type,typeddict-item]
        )


def test_tgi_generate_keeps_the_stop_sequence(dialects: DialectGateway) -> None:
    gw = dialects.gateway
    status, plain = gw.json(
        "POST", "/generate", {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 10}}
    )
    assert status == 200
    text = plain["generated_text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip()
    status, stopped = gw.json(
        "POST",
        "/generate",
        {
            "inputs": "Once upon a time",
            "parameters": {"max_new_tokens": 10, "stop": [stop], "details": True},
        },
    )
    assert status == 200
    assert stopped["generated_text"] == text[: text.index(stop) + len(stop)]
    assert stopped["details"]["finish_reason"] == "stop_sequence"


# ------------------------------------------------------------------ lm-eval's request shapes
@pytest.fixture(scope="module")
def hf_model(tiny_model: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32).eval()


def requests_8(tiny_model: Path) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) token ids of a small multiple-choice task: 2 questions x 4
    answers, as lm-eval tokenizes them."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    out = []
    for question in ("Question: The sky is\nAnswer:", "Question: Two plus two is\nAnswer:"):
        for answer in (" blue", " green", " four", " a cat"):
            out.append((tok(question)["input_ids"], tok(answer)["input_ids"]))
    return out


def hf_score(model: Any, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """lm-eval's `hf` model: sum of the continuation's logprobs, and whether it is greedy."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = range(len(context) - 1, len(context) + len(continuation) - 1)
    total = sum(float(logprobs[p, t]) for p, t in zip(positions, continuation, strict=True))
    greedy = all(
        int(logprobs[p].argmax()) == t for p, t in zip(positions, continuation, strict=True)
    )
    return total, greedy


def parse_logprobs(response: dict[str, Any], ctxlens: list[int], generated: int) -> list[Any]:
    """lm-eval's LocalCompletionsAPI.parse_logprobs: the token_logprobs after the context
    (less the `generated` tokens at the end), and is_greedy from top_logprobs."""
    res = []
    choices = sorted(response["choices"], key=lambda c: c["index"])
    for choice, ctxlen in zip(choices, ctxlens, strict=True):
        end = len(choice["logprobs"]["token_logprobs"]) - generated
        lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        greedy = all(tok == max(top.values()) for tok, top in zip(lps, tops, strict=True))
        res.append((sum(lps), greedy))
    return res


@pytest.mark.parametrize("max_tokens", [1, 0])  # lm_eval 0.4.9 sends 1, later versions 0
def test_lm_eval_loglikelihood_batch_of_8(
    float32_gateway: Gateway, hf_model: Any, tiny_model: Path, max_tokens: int
) -> None:
    reqs = requests_8(tiny_model)
    payload = {
        "model": "tiny",
        "prompt": [ctx + cont for ctx, cont in reqs],  # token ids, batch_size 8
        "temperature": 0,
        "max_tokens": max_tokens,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    status, body = float32_gateway.json("POST", "/v1/completions", payload)
    assert status == 200, body
    assert len(body["choices"]) == 8
    first = body["choices"][0]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert first["logprobs"]["top_logprobs"][0] is None
    if max_tokens == 0:
        assert body["usage"]["completion_tokens"] == 0
        assert len(first["logprobs"]["tokens"]) == len(reqs[0][0]) + len(reqs[0][1])
    got = parse_logprobs(body, [len(ctx) for ctx, _ in reqs], generated=max_tokens)
    for (ctx, cont), (total, greedy) in zip(reqs, got, strict=True):
        want_total, want_greedy = hf_score(hf_model, ctx, cont)
        assert total == pytest.approx(want_total, abs=1e-3)
        assert greedy == want_greedy


def test_lm_eval_generate_until_batch_of_8(
    float32_gateway: Gateway, hf_model: Any, tiny_model: Path
) -> None:
    reqs = requests_8(tiny_model)
    contexts = [ctx for ctx, _ in reqs]
    payload = {
        "prompt": contexts,
        "model": "tiny",
        "max_tokens": 6,
        "temperature": 0,
        "stop": ["\n\n"],
        "seed": 1234,
    }
    status, body = float32_gateway.json("POST", "/v1/completions", payload)
    assert status == 200, body
    texts = {c["index"]: c["text"] for c in body["choices"]}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    for i, ctx in enumerate(contexts):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ctx]), max_new_tokens=6, do_sample=False, pad_token_id=0
            )
        want = tok.decode(out[0, len(ctx) :], skip_special_tokens=True).split("\n\n")[0]
        assert texts[i] == want


def test_grpc_prompt_top_tokens(dialects: DialectGateway) -> None:
    """The server half of echo's prompt top_logprobs: Details.prefill_top_tokens."""
    import grpc

    with grpc.insecure_channel(dialects.server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        out = stub.Generate(
            pb.GenerateRequest(
                inputs=["Once upon a time"],
                parameters=pb.GenerateParameters(
                    max_new_tokens=1, decoder_input_details=True, top_n_tokens=3
                ),
            ),
            timeout=60,
        )
    details = out.results[0].details
    assert len(details.prefill_top_tokens) == len(details.prefill)
    assert not details.prefill_top_tokens[0].tokens
    for top, token in zip(details.prefill_top_tokens[1:], details.prefill[1:], strict=True):
        assert len(top.tokens) == 3
        assert top.tokens[0].logprob >= token.logprob - 1e-6
    assert out.results[0].prompt_text == "Once upon a time"
