"""Structured output on the embedded default model (SmolLM2-135M-Instruct) served by a real
`genserve` process over real gRPC: every constrained output parses and validates (JSON schema
with the `jsonschema` package, regex with ``re.fullmatch``, choice by membership), greedy and
sampled, in one concurrent batch with unconstrained requests, which still produce exactly
their unconstrained greedy output.  Bad grammars are refused before queueing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema  # type: ignore[import-untyped]
import pytest

from genserve.model.loader import default_gguf_path
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import DefaultModelServer
from tests.utils.live_server import LiveServer, start_server

pytestmark = pytest.mark.slow

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
SCHEMAS: list[dict[str, Any]] = [
    {  # nested objects, required and optional, integer bounds
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
            "nickname": {"type": "string", "maxLength": 10},
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    {  # arrays, enums, numbers
        "type": "object",
        "properties": {
            "colours": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number"},
            "ok": {"type": "boolean"},
        },
        "required": ["colours", "score", "ok"],
        "additionalProperties": False,
    },
    {  # a string with a pattern at the top level of an object, and an enum
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "mood": {"enum": ["happy", "sad"]},
        },
        "required": ["date", "mood"],
        "additionalProperties": False,
    },
]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no), because [a-z ]{1,30}\."]
CHOICES = ["Paris", "London", "Berlin"]
UNCONSTRAINED = ["The capital of France is", "def fibonacci(n):"]
MAX_NEW_TOKENS = 96


@pytest.fixture(scope="module")
def server(default_model_server: DefaultModelServer) -> LiveServer:
    """The session's float32 default-model server (tests/e2e/conftest.py)."""
    return default_model_server.server


@pytest.fixture(scope="module")
def stub(server: LiveServer) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)


def _params(grammar: pb.Grammar | None, sampled: bool) -> pb.GenerateParameters:
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    if sampled:
        params.do_sample, params.temperature, params.seed = True, 0.9, 7
    if grammar is not None:
        params.grammar.CopyFrom(grammar)
    return params


def _generate(
    stub: pb_grpc.TextGenerationServiceStub, prompt: str, params: pb.GenerateParameters
) -> pb.GenerateResult:
    response: pb.GenerateResponse = stub.Generate(
        pb.GenerateRequest(inputs=[prompt], parameters=params)
    )
    return response.results[0]


def test_mixed_batch_outputs_follow_their_grammars(
    stub: pb_grpc.TextGenerationServiceStub,
) -> None:
    info = stub.Info(pb.InfoRequest())
    assert info.grammar_support
    alone = {p: _generate(stub, p, _params(None, False)) for p in UNCONSTRAINED}
    jobs: list[tuple[str, str, pb.GenerateParameters]] = []
    for sampled in (False, True):
        for schema in SCHEMAS:
            grammar = pb.Grammar(json_schema=json.dumps(schema))
            jobs.append(("schema", json.dumps(schema), _params(grammar, sampled)))
        for regex in REGEXES:
            jobs.append(("regex", regex, _params(pb.Grammar(regex=regex), sampled)))
        choice = pb.Grammar(choice=pb.GrammarChoice(values=CHOICES))
        jobs.append(("choice", "", _params(choice, sampled)))
        jobs.append(("object", "", _params(pb.Grammar(json_object=True), sampled)))
    for p in UNCONSTRAINED:
        jobs.append(("none", p, _params(None, False)))
    prompt = CHAT.format("Answer in the requested format.")

    def run(job: tuple[str, str, pb.GenerateParameters]) -> pb.GenerateResult:
        kind, what, params = job
        return _generate(stub, what if kind == "none" else prompt, params)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (kind, what, _), result in zip(jobs, results, strict=True):
        text = result.generated_text
        # Every constrained output ends because its grammar completed (EOS), not by length.
        if kind == "object" and result.details.finish_reason == pb.FINISH_REASON_LENGTH:
            # Any JSON object may go on for ever (this small model repeats digits inside a
            # key when sampling); a truncated one is still an object's prefix.
            assert text.startswith("{"), text
            continue
        if kind != "none":
            assert result.details.finish_reason == pb.FINISH_REASON_EOS_TOKEN, (kind, what, text)
        if kind == "schema":
            jsonschema.validate(json.loads(text), json.loads(what))
        elif kind == "object":
            assert isinstance(json.loads(text), dict), text
        elif kind == "regex":
            assert re.fullmatch(what, text), (what, text)
        elif kind == "choice":
            assert text in CHOICES, text
        else:
            assert [t.id for t in result.details.tokens] == [
                t.id for t in alone[what].details.tokens
            ], what


def test_eos_only_where_the_grammar_is_complete(
    stub: pb_grpc.TextGenerationServiceStub,
) -> None:
    """A regex that needs exactly 6 digits: the model cannot stop early, and stops (EOS) as
    soon as it can go no further."""
    params = _params(pb.Grammar(regex=r"[0-9]{6}"), sampled=True)
    result = _generate(stub, CHAT.format("Say a number."), params)
    assert re.fullmatch(r"[0-9]{6}", result.generated_text)
    assert result.details.finish_reason == pb.FINISH_REASON_EOS_TOKEN
    # 6 digits (however tokenized) and then EOS, the last generated token.
    assert result.details.tokens[-1].special


@pytest.mark.parametrize(
    "grammar",
    [
        pb.Grammar(json_schema="{not json"),
        pb.Grammar(json_schema='{"type": "nope"}'),
        pb.Grammar(regex="(unclosed"),
        pb.Grammar(ebnf="root ::= undefined_rule"),
        pb.Grammar(choice=pb.GrammarChoice(values=[])),
        pb.Grammar(json_object=False),
    ],
)
def test_bad_grammar_is_invalid_argument(
    stub: pb_grpc.TextGenerationServiceStub, grammar: pb.Grammar
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _generate(stub, "hi", _params(grammar, False))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grammar" in (err.value.details() or "")
    request = pb.GenerateStreamRequest(inputs="hi", parameters=_params(grammar, False))
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GenerateStream(request))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_streamed_constrained_output(stub: pb_grpc.TextGenerationServiceStub) -> None:
    schema = SCHEMAS[2]
    params = _params(pb.Grammar(json_schema=json.dumps(schema)), sampled=False)
    request = pb.GenerateStreamRequest(inputs=CHAT.format("Today as JSON."), parameters=params)
    messages = list(stub.GenerateStream(request))
    jsonschema.validate(json.loads(messages[-1].generated_text), schema)


def test_disable_grammar_support_refuses_grammar() -> None:
    with (
        start_server(
            str(default_gguf_path()), "--disable-grammar-support", "--prometheus-port", "0"
        ) as srv,
        grpc.insecure_channel(srv.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        assert not stub.Info(pb.InfoRequest()).grammar_support
        with pytest.raises(grpc.RpcError) as err:
            _generate(stub, "hi", _params(pb.Grammar(regex="a+"), False))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "--disable-grammar-support" in (err.value.details() or "")
        assert _generate(stub, "hi", pb.GenerateParameters(max_new_tokens=2)).generated_text


def test_speculation_skips_constrained_rows(
    default_model_speculate_server: DefaultModelServer,
) -> None:
    """With ``--speculate``, constrained requests get no drafts (the scheduler never drafts for
    them: the mask of each draft position would depend on the drafts before it) and still
    validate, while an unconstrained greedy request in the same batch drafts and keeps
    exactly its non-speculative output."""
    schema = SCHEMAS[1]
    repetitive = "one two three one two three one two three one two three"
    srv = default_model_speculate_server.server  # float32, --speculate 4
    with grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        alone = _generate(stub, repetitive, _params(None, False))
        grammar = pb.Grammar(json_schema=json.dumps(schema))
        prompt = CHAT.format("Colours as JSON.")
        jobs = [(prompt, _params(grammar, s)) for s in (False, True)]
        jobs.append((repetitive, _params(None, False)))
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: _generate(stub, *job), jobs))
    for result in results[:2]:
        jsonschema.validate(json.loads(result.generated_text), schema)
    assert [t.id for t in results[2].details.tokens] == [t.id for t in alone.details.tokens]
