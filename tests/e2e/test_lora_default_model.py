"""Multi-LoRA on the real default model (SmolLM2-135M, embedded) served by a real `genserve`
process: a PEFT adapter made in a fixture (random, non-zero B, every projection adapted),
requests with and without it in flight together over gRPC; each one's greedy tokens equal
PEFT + transformers generate() on the same float32 weights, logprobs within 1e-3."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from genserve.model.loader import default_gguf_path
from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.utils.live_server import LiveServer, start_server

pytestmark = pytest.mark.slow
pytest.importorskip("peft")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]
MAX_NEW_TOKENS = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_tokenizer_dir()  # the embedded GGUF's cache entry: config and tokenizer


@pytest.fixture(scope="module")
def adapter_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from genserve.testing.tiny_lora import make_lora_adapter

    out = tmp_path_factory.mktemp("smollm-lora")
    return make_lora_adapter(model_dir, out, rank=8, alpha=16, targets=TARGETS, std=0.02)


@pytest.fixture(scope="module")
def server(adapter_dir: Path) -> Iterator[LiveServer]:
    with start_server(
        str(default_gguf_path()), "--dtype", "float32", "--cpu-int-dot", "off",
        "--lora-adapters", f"tuned={adapter_dir}",
        "--max-batch-total-tokens", "16384",
    ) as srv:  # fmt: skip
        yield srv


def _reference(model: Any, tok: Any, prompt: str) -> tuple[list[int], list[float]]:
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens: list[int] = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        torch.log_softmax(step[0].float(), -1)[t].item()
        for step, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, logprobs


def test_default_model_with_a_peft_adapter_matches_peft(
    server: LiveServer, model_dir: Path, adapter_dir: Path, default_model_float32: PreTrainedModel
) -> None:
    from peft import PeftModel

    jobs = [(p, a) for p in PROMPTS for a in ("tuned", "")]  # adapter and base rows mixed
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)

        def generate(job: tuple[str, str]) -> pb.GenerateResult:
            params = pb.GenerateParameters(
                max_new_tokens=MAX_NEW_TOKENS, details=True, adapter_id=job[1]
            )
            request = pb.GenerateRequest(inputs=[job[0]], parameters=params)
            return stub.Generate(request).results[0]

        with ThreadPoolExecutor(len(jobs)) as pool:
            results = dict(zip(jobs, pool.map(generate, jobs), strict=True))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    base = default_model_float32  # tests/conftest.py: loaded once per session
    expected_base = {p: _reference(base, tok, p) for p in PROMPTS}
    # PEFT injects the LoRA layers into the model it wraps: a copy, not the shared one.
    tuned = PeftModel.from_pretrained(copy.deepcopy(base), str(adapter_dir))
    expected_tuned = {p: _reference(tuned, tok, p) for p in PROMPTS}
    differs = 0
    for (prompt, adapter), result in results.items():
        want_ids, want_lps = (expected_tuned if adapter else expected_base)[prompt]
        got_ids = [t.id for t in result.details.tokens]
        assert got_ids == want_ids, (prompt, adapter)
        got_lps = [t.logprob for t in result.details.tokens]
        assert got_lps == pytest.approx(want_lps, abs=1e-3), (prompt, adapter)
        differs += adapter != "" and want_ids != expected_base[prompt][0]
    assert differs > 0  # the adapter changes the output: the check proves something
