"""Chat and ChatStream over real gRPC on a tiny real-weights model (it carries the embedded
default model's tokenizer and chat template): parity with transformers' apply_chat_template +
generate(), streaming, n choices, usage, logprobs, presence_penalty, every refusal with its
status, and cancellation freeing KV blocks."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.inproc_server import InProcessServer, inproc_server

CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about cats."},
    ],
]


def messages(conversation: list[dict[str, str]]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]


def code_of(fn: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code(), info.value.details()


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> tuple[Any, Any]:
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    return tok, model


def hf_chat_greedy(
    hf: tuple[Any, Any],
    conversation: list[dict[str, str]],
    max_new_tokens: int,
    processors: list[LogitsProcessor] | None = None,
) -> tuple[list[int], list[float], list[int]]:
    """(generated ids, their logprobs, prompt ids) from transformers itself."""
    tok, model = hf
    prompt = tok.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.eos_token_id,
            logits_processor=processors,
        )
    new_ids = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        torch.log_softmax(logits[0].float(), dim=-1)[t].item()
        for logits, t in zip(out.logits, new_ids, strict=True)
    ]
    return new_ids, logprobs, list(prompt)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_greedy_chat_matches_transformers(
    hf: tuple[Any, Any], stub: pb_grpc.TextGenerationServiceStub, conversation: Any
) -> None:
    reply = stub.Chat(
        pb.ChatRequest(
            messages=messages(conversation),
            parameters=pb.GenerateParameters(max_new_tokens=24),
            logprobs=True,
            top_logprobs=3,
        )
    )
    ids, logprobs, prompt = hf_chat_greedy(hf, conversation, 24)
    (choice,) = reply.choices
    assert [lp.token.id for lp in choice.logprobs] == ids
    assert [lp.token.logprob for lp in choice.logprobs] == pytest.approx(logprobs, abs=1e-3)
    for lp in choice.logprobs:  # greedy: the chosen token is the most likely alternative
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].id == lp.token.id
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob
    tok = hf[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(ids)
    assert reply.usage.total_tokens == len(prompt) + len(ids)
    assert reply.id.startswith("chatcmpl-") and abs(reply.created - time.time()) < 120
    assert reply.model == stub.Info(pb.InfoRequest()).served_model_name


def test_stream_deltas_concatenate_to_unary(stub: pb_grpc.TextGenerationServiceStub) -> None:
    params = pb.GenerateParameters(max_new_tokens=30, stop=["e t"])
    conv = messages(CONVERSATIONS[1])
    unary = stub.Chat(pb.ChatRequest(messages=conv, parameters=params))
    chunks = list(stub.ChatStream(pb.ChatStreamRequest(messages=conv, parameters=params)))
    assert "".join(c.delta for c in chunks) == unary.choices[0].message.content
    assert [c.HasField("finish_reason") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason == unary.choices[0].finish_reason
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == len(chunks)
    assert chunks[-1].usage.prompt_tokens == unary.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].id != unary.id
    assert not chunks[0].token.HasField("logprob")  # only when logprobs is asked for


def test_n_seeded_choices_differ_and_reproduce(stub: pb_grpc.TextGenerationServiceStub) -> None:
    conv = messages(CONVERSATIONS[0])
    params = pb.GenerateParameters(max_new_tokens=16, temperature=0.9, seed=41)
    first = stub.Chat(pb.ChatRequest(messages=conv, parameters=params, n=2))
    again = stub.Chat(pb.ChatRequest(messages=conv, parameters=params, n=2))
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] != texts[1]
    # Choice i samples with seed + i: choice 1 is the n=1 reply seeded 42.
    params.seed = 42
    single = stub.Chat(pb.ChatRequest(messages=conv, parameters=params))
    assert single.choices[0].message.content == texts[1]
    assert first.usage.completion_tokens == 32  # 16 per choice, summed
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt once
    # Streamed, the two choices interleave; per choice they equal the unary replies.
    streamed = {0: "", 1: ""}
    finished = []
    params.seed = 41
    for chunk in stub.ChatStream(pb.ChatStreamRequest(messages=conv, parameters=params, n=2)):
        streamed[chunk.index] += chunk.delta
        if chunk.HasField("finish_reason"):
            finished.append(chunk.index)
    assert [streamed[0], streamed[1]] == texts
    assert sorted(finished) == [0, 1]
    # Greedy choices are identical.
    greedy = stub.Chat(
        pb.ChatRequest(messages=conv, parameters=pb.GenerateParameters(max_new_tokens=8), n=2)
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


class _PresencePenalty(LogitsProcessor):  # type: ignore[misc]
    """The reference: OpenAI's documented presence penalty over the generated tokens."""

    def __init__(self, num_prompt: int, penalty: float) -> None:
        self.num_prompt = num_prompt
        self.penalty = penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = set(input_ids[0, self.num_prompt :].tolist())
        scores = scores.clone()
        for t in generated:
            scores[0, t] -= self.penalty
        return scores


def test_presence_penalty_matches_reference(
    hf: tuple[Any, Any], stub: pb_grpc.TextGenerationServiceStub
) -> None:
    conv = CONVERSATIONS[0]
    plain, _, prompt = hf_chat_greedy(hf, conv, 30)
    # Negative: the random tiny model does not repeat itself, so a positive penalty would
    # change nothing; a negative one pulls generated tokens back and changes the output.
    penalty = -2.0
    expected, _, _ = hf_chat_greedy(hf, conv, 30, [_PresencePenalty(len(prompt), penalty)])
    assert expected != plain  # the penalty matters for this model and prompt
    reply = stub.Chat(
        pb.ChatRequest(
            messages=messages(conv),
            parameters=pb.GenerateParameters(max_new_tokens=30, presence_penalty=penalty),
            logprobs=True,
        )
    )
    assert [lp.token.id for lp in reply.choices[0].logprobs] == expected


INVALID = grpc.StatusCode.INVALID_ARGUMENT
Params = pb.GenerateParameters


@pytest.mark.parametrize(
    ("request_fields", "code", "needle"),
    [
        ({"messages": []}, INVALID, "messages"),
        (
            {"messages": [pb.ChatMessage(role="wizard", content="hi")]},
            INVALID,
            "role",
        ),
        ({"response_format": pb.ResponseFormat(type="json_schema")}, INVALID, "json_schema"),
        (
            {
                "response_format": pb.ResponseFormat(type="json_object"),
                "parameters": Params(grammar=pb.Grammar(regex="a+")),
            },
            INVALID,
            "not both",
        ),
        ({"response_format": pb.ResponseFormat(type="xml")}, INVALID, "xml"),
        ({"logprobs": True, "top_logprobs": 99}, INVALID, "top_logprobs"),
        ({"top_logprobs": 2}, INVALID, "logprobs"),
        ({"n": 0}, INVALID, "`n`"),
        ({"n": 99}, INVALID, "--max-client-batch-size"),
        ({"model": "gpt-4o"}, grpc.StatusCode.NOT_FOUND, "gpt-4o"),
        ({"parameters": Params(details=True)}, INVALID, "details"),
        ({"parameters": Params(truncate=5)}, INVALID, "truncate"),
        ({"parameters": Params(return_full_text=True)}, INVALID, "return_full_text"),
        ({"parameters": Params(presence_penalty=2.5)}, INVALID, "presence_penalty"),
        ({"parameters": Params(max_new_tokens=5000)}, INVALID, "max-total-tokens"),
        ({"continue_final_message": True}, INVALID, "assistant"),
    ],
)  # fmt: skip
def test_refusals(
    server: InProcessServer,
    stub: pb_grpc.TextGenerationServiceStub,
    request_fields: dict[str, Any],
    code: grpc.StatusCode,
    needle: str,
) -> None:
    fields: dict[str, Any] = {"messages": messages(CONVERSATIONS[0]), **request_fields}
    got, message = code_of(lambda: stub.Chat(pb.ChatRequest(**fields)))
    assert got == code and needle in message, message
    got, message = code_of(lambda: list(stub.ChatStream(pb.ChatStreamRequest(**fields))))
    assert got == code and needle in message, message
    assert server.call(lambda: server.engine.num_in_flight) == 0


def test_model_name_accepted(stub: pb_grpc.TextGenerationServiceStub) -> None:
    info = stub.Info(pb.InfoRequest())
    assert info.has_chat_template
    assert info.served_model_name == info.model_id  # no --served-model-name
    for model in ("", info.served_model_name):
        reply = stub.Chat(
            pb.ChatRequest(
                messages=messages(CONVERSATIONS[0]),
                parameters=pb.GenerateParameters(max_new_tokens=2),
                model=model,
            )
        )
        assert reply.choices[0].finish_reason == pb.FINISH_REASON_LENGTH


def test_cancelled_stream_frees_every_choice(
    server: InProcessServer, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    server.wait_all_blocks_free()
    call = stub.ChatStream(
        pb.ChatStreamRequest(
            messages=messages(CONVERSATIONS[1]),
            parameters=pb.GenerateParameters(max_new_tokens=400, temperature=0.8, seed=1),
            n=3,
        )
    )
    seen: set[int] = set()
    for i, chunk in enumerate(call):
        seen.add(chunk.index)
        if i == 12:
            assert server.num_free_blocks() < server.num_total_blocks()  # generating
            call.cancel()
            break
    assert len(seen) >= 2
    server.wait_all_blocks_free()
    assert server.call(lambda: server.engine.num_in_flight) == 0
    # A unary call whose deadline passes mid-generation frees its choices too.
    code, _ = code_of(
        lambda: stub.Chat(
            pb.ChatRequest(
                messages=messages(CONVERSATIONS[0]),
                parameters=pb.GenerateParameters(max_new_tokens=400, ignore_eos=True),
                n=2,
            ),
            timeout=0.2,
        )
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    server.wait_all_blocks_free()
    assert server.call(lambda: server.engine.num_in_flight) == 0


@pytest.fixture(scope="module")
def model_without_template(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("no-template") / "model"
    shutil.copytree(tiny_llama, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return out


def test_no_template_is_failed_precondition_and_flags_fix_it(
    model_without_template: Path, tmp_path: Path
) -> None:
    conv = messages(CONVERSATIONS[0])
    params = pb.GenerateParameters(max_new_tokens=3)
    with inproc_server(model_without_template, "--prometheus-port", "0") as srv:
        stub = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(srv.address))
        assert not stub.Info(pb.InfoRequest()).has_chat_template
        code, message = code_of(lambda: stub.Chat(pb.ChatRequest(messages=conv)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--chat-template" in message
        code, _ = code_of(lambda: list(stub.ChatStream(pb.ChatStreamRequest(messages=conv))))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}bot:"
    tokenizer_config = tmp_path / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({"chat_template": template}))
    for flags in (
        ("--chat-template", template),  # inline, as vLLM accepts
        ("--tokenizer-config-path", str(tokenizer_config)),  # TGI's flag
    ):
        with inproc_server(
            model_without_template, "--prometheus-port", "0", "--served-model-name", "tiny",
            *flags,
        ) as srv:  # fmt: skip
            stub = pb_grpc.TextGenerationServiceStub(grpc.insecure_channel(srv.address))
            info = stub.Info(pb.InfoRequest())
            assert info.has_chat_template and info.served_model_name == "tiny"
            reply = stub.Chat(pb.ChatRequest(messages=conv, parameters=params, model="tiny"))
            assert reply.model == "tiny"
            # The prompt is the override's rendering: count its tokens.
            tok = AutoTokenizer.from_pretrained(str(model_without_template))
            rendered = tok.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in conv],
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            assert reply.usage.prompt_tokens == len(rendered)
