"""Greedy output matches Hugging Face generate() token for token on the same float32 weights,
with logprobs within 1e-3, for prompts of varied lengths sent concurrently (they share
batches, chunked prefills and decode steps)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import varied_prompts
from tests.utils.hf_reference import hf_greedy

NUM_PROMPTS = 16
MAX_NEW_TOKENS = 64


def test_greedy_matches_transformers(
    tiny_llama: Path, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    prompts = varied_prompts(NUM_PROMPTS, seed=7)
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)

    def call(prompt: str) -> pb.GenerateResult:
        return stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params)).results[0]

    with ThreadPoolExecutor(NUM_PROMPTS) as pool:
        served = list(pool.map(call, prompts))
    expected = hf_greedy(tiny_llama, prompts, MAX_NEW_TOKENS)
    lengths = [r.details.input_length for r in served]
    assert min(lengths) < 10 and max(lengths) > 300, lengths
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        got_ids = [t.id for t in result.details.tokens]
        assert got_ids == ids, f"prompt {prompt[:40]!r}..."
        got_lp = [t.logprob for t in result.details.tokens]
        assert got_lp == pytest.approx(logprobs, abs=1e-3)


def test_prompt_logprobs_match_transformers(
    tiny_llama: Path, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    prompt = varied_prompts(12, seed=3)[9]
    params = pb.GenerateParameters(max_new_tokens=2, details=True, decoder_input_details=True)
    result = stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params)).results[0]
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    prefill = result.details.prefill
    assert [t.id for t in prefill] == ids[0].tolist()
    assert not prefill[0].HasField("logprob")
    expected = [logprobs[i - 1, ids[0, i]].item() for i in range(1, ids.shape[1])]
    assert [t.logprob for t in prefill[1:]] == pytest.approx(expected, abs=1e-3)


def test_info_names_the_native_path(stub: pb_grpc.TextGenerationServiceStub) -> None:
    info = stub.Info(pb.InfoRequest())
    assert (info.architecture, info.implementation) == ("LlamaForCausalLM", "native")
    assert list(info.disabled_features) == []
