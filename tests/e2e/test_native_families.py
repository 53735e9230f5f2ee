"""Every native family beyond Llama/Mistral/Qwen2, served over real gRPC from a tiny
random-weight float32 checkpoint (randomized norm weights and biases, the family's own
features switched on: see ``genserve.testing.tiny_model.FAMILY_CONFIGS``), with concurrent
prompts longer than its sliding window and its scaled rotary's original context: greedy
tokens equal transformers ``generate()``, logprobs within 1e-3.

``tests/unit/test_native_family_features.py`` checks that each family's features matter (the
reference changes when one is skipped), so these comparisons prove each is implemented."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from genserve.testing.tiny_model import NATIVE_FAMILIES
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server

MAX_NEW_TOKENS = 24
# 2 to ~300 words: shorter and much longer than the 32-token windows and 64-token contexts.
PROMPTS = [varied_prompts(12, seed=7)[i] for i in (0, 4, 6, 8, 9, 11)]


@pytest.mark.parametrize("family", NATIVE_FAMILIES)
def test_family_greedy_matches_transformers(
    family: str, tiny_model_factory: TinyModelFactory
) -> None:
    model_dir: Path = tiny_model_factory(family, seed=1)
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    with inproc_server(model_dir, *PARITY_SERVER_ARGS) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)

            def call(prompt: str) -> pb.Details:
                request = pb.GenerateRequest(inputs=[prompt], parameters=params)
                details: pb.Details = stub.Generate(request, timeout=300).results[0].details
                return details

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                served = list(pool.map(call, PROMPTS))
        server.wait_all_blocks_free()
    assert max(d.input_length for d in served) > 300
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    for prompt, got, (ids, logprobs) in zip(PROMPTS, served, expected, strict=True):
        assert [t.id for t in got.tokens] == ids[: len(got.tokens)], (family, prompt[:40])
        assert len(got.tokens) == len(ids)
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs, abs=1e-3)


# Sharded: attention heads and MLP columns split over 2 ranks; Gemma 2 has every layer kind
# (soft-caps, sandwich norms, sliding layers), StableLM partial rotary with permuted heads.
@pytest.mark.parametrize("family", ["gemma2", "stablelm"])
def test_two_shards_match_transformers(family: str, tiny_model_factory: TinyModelFactory) -> None:
    from tests.e2e.test_tensor_parallel import generate_all
    from tests.e2e.tp_utils import SERVER_ARGS, shard_args, start_servers

    model_dir = tiny_model_factory(family, seed=1)
    with start_servers([(model_dir, SERVER_ARGS + shard_args(2))]) as (server,):
        served = generate_all(server, PROMPTS, MAX_NEW_TOKENS)
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    for prompt, got, (ids, logprobs) in zip(PROMPTS, served, expected, strict=True):
        assert [t.id for t in got.tokens] == ids, (family, prompt[:40])
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs, abs=1e-3)


def test_lora_adapter_on_gemma_matches_peft(
    tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    """A PEFT adapter on every projection of a GeGLU family, next to base-model requests."""
    pytest.importorskip("peft")
    from transformers import AutoTokenizer

    from genserve.testing.tiny_lora import make_lora_adapter
    from tests.unit.test_lora_runner import ALL, peft_greedy

    model_dir = tiny_model_factory("gemma", seed=1)
    adapter = make_lora_adapter(model_dir, tmp_path / "all", rank=4, targets=ALL, seed=2)
    jobs = [(p, a) for p in PROMPTS[1:4] for a in ("all", None)]
    args = (*PARITY_SERVER_ARGS, "--lora-adapters", f"all={adapter}")
    with inproc_server(model_dir, *args) as srv, grpc.insecure_channel(srv.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)

        def call(job: tuple[str, str | None]) -> pb.Details:
            params = pb.GenerateParameters(max_new_tokens=12, details=True)
            if job[1] is not None:
                params.adapter_id = job[1]
            request = pb.GenerateRequest(inputs=[job[0]], parameters=params)
            details: pb.Details = stub.Generate(request, timeout=300).results[0].details
            return details

        with ThreadPoolExecutor(len(jobs)) as pool:
            served = list(pool.map(call, jobs))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    for (prompt, name), got in zip(jobs, served, strict=True):
        ids, logprobs = peft_greedy(model_dir, adapter if name else None, tok(prompt).input_ids, 12)
        n = len(got.tokens)
        assert [t.id for t in got.tokens] == ids[:n], (name, prompt[:40])
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs[:n], abs=1e-3)
