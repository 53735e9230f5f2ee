"""Chat on the embedded default model (SmolLM2-135M-Instruct from its GGUF, whose
tokenizer.chat_template must survive the conversion) served by a real `genserve` process:
greedy replies equal transformers' apply_chat_template(add_generation_prompt=True) +
generate() token for token on float32 weights, logprobs within 1e-3; streamed deltas
concatenate to the unary reply; chat calls are counted as requests in /metrics."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from genserve.model.loader import resolve_model
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.conftest import DefaultModelServer
from tests.utils.live_server import LiveServer

pytestmark = pytest.mark.slow

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer in one sentence."},
        {"role": "user", "content": "Where is the treasure?"},
    ],
    [
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green and blue."},
        {"role": "user", "content": "And two more?"},
    ],
    [
        {"role": "system", "content": "You translate into French."},
        {"role": "user", "content": "Good morning, how are you?"},
        {"role": "assistant", "content": "Bonjour, comment allez-vous ?"},
        {"role": "user", "content": "Thank you very much."},
    ],
]
MAX_NEW_TOKENS = 40


@pytest.fixture(scope="module")
def served(default_model_server: DefaultModelServer) -> tuple[LiveServer, int]:
    return default_model_server.server, default_model_server.metrics_port


def _messages(conversation: list[dict[str, str]]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]


def test_chat_matches_transformers(
    served: tuple[LiveServer, int], default_model_float32: PreTrainedModel
) -> None:
    server, _ = served
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        assert stub.Info(pb.InfoRequest()).has_chat_template  # from the GGUF's metadata

        def chat(conversation: list[dict[str, str]]) -> pb.ChatResponse:
            return stub.Chat(
                pb.ChatRequest(
                    messages=_messages(conversation),
                    parameters=pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS),
                    logprobs=True,
                )
            )

        with ThreadPoolExecutor(len(CONVERSATIONS)) as pool:  # they share batches
            replies = list(pool.map(chat, CONVERSATIONS))
    model_dir = resolve_model(None).local_dir
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = default_model_float32  # tests/conftest.py: loaded once per session, read-only
    with torch.inference_mode():
        for conversation, reply in zip(CONVERSATIONS, replies, strict=True):
            prompt = tok.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            expected = out.sequences[0, ids.shape[1] :].tolist()
            choice = reply.choices[0]
            assert [lp.token.id for lp in choice.logprobs] == expected, conversation
            logprobs = [
                torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, expected, strict=True)
            ]
            got = [lp.token.logprob for lp in choice.logprobs]
            assert got == pytest.approx(logprobs, abs=1e-3)
            assert choice.message.content == tok.decode(expected, skip_special_tokens=True)
            assert reply.usage.prompt_tokens == len(prompt)
            assert reply.usage.completion_tokens == len(expected)
            eos = expected[-1] == tok.eos_token_id
            assert choice.finish_reason == (
                pb.FINISH_REASON_EOS_TOKEN if eos else pb.FINISH_REASON_LENGTH
            )
    # An instruct model with its template answers the question (not a raw continuation).
    assert "Paris" in replies[0].choices[0].message.content


def _counter(port: int, name: str) -> float:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_chat_stream_equals_unary_and_is_counted(served: tuple[LiveServer, int]) -> None:
    server, port = served
    before = _counter(port, "genserve_request_count_total")
    conversation = _messages(CONVERSATIONS[1])
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        unary = stub.Chat(pb.ChatRequest(messages=conversation, parameters=params))
        chunks = list(
            stub.ChatStream(pb.ChatStreamRequest(messages=conversation, parameters=params))
        )
    assert "".join(c.delta for c in chunks) == unary.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
    assert chunks[-1].finish_reason == unary.choices[0].finish_reason
    assert _counter(port, "genserve_request_count_total") == before + 2
