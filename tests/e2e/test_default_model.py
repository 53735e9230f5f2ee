"""The embedded default model (SmolLM2-135M-Instruct, GGUF) served by a real `genserve`
process: greedy tokens and logprobs match Hugging Face generate() on the same float32 weights,
and streaming works; with n-gram speculation too (``--speculate``), where this model's
repetitive continuations make most drafts land, so several tokens come from one step."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "a b c d a b c d a b c d a b",
]
MAX_NEW_TOKENS = 24


@dataclass(frozen=True)
class Served:
    server: LiveServer
    metrics_port: int
    speculate: bool

    @property
    def address(self) -> str:
        return self.server.address


@pytest.fixture(scope="module", params=["plain", "speculate"])
def default_server(request: pytest.FixtureRequest) -> Served:
    """The session's default-model servers (tests/e2e/conftest.py), without and with
    ``--speculate 4``: no request on the first drafts, so its draft counters stay 0."""
    speculate = request.param == "speculate"
    name = "default_model_speculate_server" if speculate else "default_model_server"
    shared: DefaultModelServer = request.getfixturevalue(name)
    return Served(shared.server, shared.metrics_port, speculate)


def _counter(served: Served, name: str) -> float:
    url = f"http://127.0.0.1:{served.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def hf_reference(
    default_model_float32: PreTrainedModel,
) -> list[tuple[list[int], list[float], str]]:
    """transformers' greedy new tokens, their logprobs and the decoded text for each of
    ``PROMPTS`` (float32): the same for both servers, so computed once."""
    model_dir = resolve_model(None).local_dir
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = default_model_float32  # tests/conftest.py: loaded once per session, read-only
    reference = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
            expected = out.sequences[0, ids.shape[1] :].tolist()
            logprobs = [
                torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, expected, strict=True)
            ]
            reference.append((expected, logprobs, tok.decode(expected, skip_special_tokens=True)))
    return reference


def test_default_model_matches_transformers(
    default_server: Served, hf_reference: list[tuple[list[int], list[float], str]]
) -> None:
    with grpc.insecure_channel(default_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        assert info.model_dtype == "float32" and info.num_shard == 1
        assert info.speculate == (4 if default_server.speculate else 0)
        params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(
                pool.map(
                    lambda p: stub.Generate(
                        pb.GenerateRequest(inputs=[p], parameters=params)
                    ).results[0],
                    PROMPTS,
                )
            )
    for prompt, result, (expected, logprobs, text) in zip(
        PROMPTS, results, hf_reference, strict=True
    ):
        assert [t.id for t in result.details.tokens] == expected, prompt
        assert [t.logprob for t in result.details.tokens] == pytest.approx(logprobs, abs=1e-3)
        assert result.generated_text == text
    drafted = _counter(default_server, "genserve_speculative_draft_tokens_total")
    accepted = _counter(default_server, "genserve_speculative_accepted_tokens_total")
    if default_server.speculate:
        # The "a b c d" prompt alone continues its own pattern for all of its tokens.
        assert accepted > 10 and drafted >= accepted, (drafted, accepted)
    else:
        assert drafted == accepted == 0


def test_default_model_streams(default_server: Served) -> None:
    with grpc.insecure_channel(default_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        request = pb.GenerateStreamRequest(
            inputs="Write a haiku about the sea.",
            parameters=pb.GenerateParameters(
                max_new_tokens=16, do_sample=True, temperature=0.7, seed=42
            ),
        )
        first = list(stub.GenerateStream(request))
        second = list(stub.GenerateStream(request))
    assert first[-1].generated_text == "".join(m.token.text for m in first)
    assert [m.token.id for m in first] == [m.token.id for m in second]
    assert first[-1].details.seed == 42


def test_stop_string_inside_a_multi_token_step(default_server: Served) -> None:
    """With --speculate, several tokens of this looping continuation arrive from one step; a
    stop string that ends inside such a step cuts the output exactly there, as without."""
    prompt = "a b c d a b c d a b c d a b"
    with grpc.insecure_channel(default_server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        params = pb.GenerateParameters(max_new_tokens=24, details=True)
        ref = stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params)).results[0]
        assert ref.generated_text.startswith(" c d a b c d a b")
        stop = "b c d a"  # first complete at the 9th generated token, mid-step with drafts
        params = pb.GenerateParameters(max_new_tokens=24, details=True, stop=[stop])
        got = stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params)).results[0]
        stream = list(
            stub.GenerateStream(pb.GenerateStreamRequest(inputs=prompt, parameters=params))
        )
    expected = ref.generated_text[: ref.generated_text.index(stop)]
    assert got.generated_text == expected
    assert got.details.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert "".join(m.token.text for m in stream) == expected
    assert stream[-1].details.generated_tokens == len(stream) == got.details.generated_tokens
