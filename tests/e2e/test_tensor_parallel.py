"""Tensor parallelism over gloo on CPU, through real servers: 2 shards generate exactly what
1 shard generates on the same float32 weights (greedy tokens identical, logprobs within
1e-3) for the prompts of the Hugging Face parity test, sent concurrently; models whose KV
heads do not divide evenly across the shards generate what transformers generates."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.prompts import varied_prompts
from tests.e2e.test_hf_parity import MAX_NEW_TOKENS, NUM_PROMPTS
from tests.e2e.tp_utils import SERVER_ARGS, shard_args, shard_workers, start_servers
from tests.utils.hf_reference import hf_greedy
from tests.utils.live_server import LiveServer, start_server


def generate_all(server: LiveServer, prompts: list[str], max_new_tokens: int) -> list[pb.Details]:
    params = pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)

        def call(prompt: str) -> pb.Details:
            request = pb.GenerateRequest(inputs=[prompt], parameters=params)
            details: pb.Details = stub.Generate(request, timeout=300).results[0].details
            return details

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(call, prompts))


def info(server: LiveServer) -> pb.InfoResponse:
    with grpc.insecure_channel(server.address) as channel:
        reply: pb.InfoResponse = pb_grpc.TextGenerationServiceStub(channel).Info(
            pb.InfoRequest(), timeout=10
        )
        return reply


@pytest.fixture(scope="module")
def one_and_two_shards(
    tiny_llama: Path, two_shard_server: LiveServer
) -> Iterator[tuple[LiveServer, LiveServer]]:
    """A one-process server, and the session's two-shard one (tests/e2e/conftest.py)."""
    with start_server(tiny_llama, *SERVER_ARGS) as one:
        yield one, two_shard_server


def test_two_shards_generate_what_one_shard_generates(
    one_and_two_shards: tuple[LiveServer, LiveServer],
) -> None:
    one, two = one_and_two_shards
    prompts = varied_prompts(NUM_PROMPTS, seed=7)
    expected = generate_all(one, prompts, MAX_NEW_TOKENS)
    served = generate_all(two, prompts, MAX_NEW_TOKENS)
    assert max(d.input_length for d in served) > 300  # long prompts: chunked prefills too
    for prompt, got, want in zip(prompts, served, expected, strict=True):
        assert [t.id for t in got.tokens] == [t.id for t in want.tokens], prompt[:40]
        assert [t.logprob for t in got.tokens] == pytest.approx(
            [t.logprob for t in want.tokens], abs=1e-3
        )


def test_info_reports_the_shards(one_and_two_shards: tuple[LiveServer, LiveServer]) -> None:
    one, two = one_and_two_shards
    assert info(one).num_shard == 1
    assert info(two).num_shard == 2
    assert len(shard_workers(one)) == 0
    assert len(shard_workers(two)) == 1


@pytest.mark.parametrize(
    "heads",
    [
        # 1 KV head, 2 shards: fewer KV heads than shards, replicated on both.
        {"num_attention_heads": 4, "num_key_value_heads": 1},
        # 3 KV heads, 2 shards: not divisible; each rank keeps the KV heads of its 3 query
        # heads (rank 0 heads 0-2 read KV 0,0,1; rank 1 heads 3-5 read KV 1,2,2).
        {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
        # The default model's layout (SmolLM2: 9 query, 3 KV heads): query heads split 5/4.
        {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 144},
    ],
    ids=["1kv", "3kv", "9q-3kv"],
)
def test_uneven_kv_heads_match_transformers(
    tiny_model_factory: TinyModelFactory, heads: dict[str, int]
) -> None:
    model_dir = tiny_model_factory("llama", seed=5, **heads)
    prompts = varied_prompts(6, seed=11, max_words=120)
    with start_servers([(model_dir, SERVER_ARGS + shard_args(2))]) as (server,):
        served = generate_all(server, prompts, 24)
    expected = hf_greedy(model_dir, prompts, 24)
    for prompt, got, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in got.tokens] == ids, prompt[:40]
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs, abs=1e-3)
