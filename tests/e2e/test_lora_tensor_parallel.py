"""LoRA under tensor parallelism (gloo, CPU): with A/B split like their base layers (B by
output rows for q/k/v and gate/up, A by input columns for o and down, whose partial sums
join the base all-reduce), 2 shards generate what 1 shard generates for a batch mixing
adapters and the base model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from genserve.testing.tiny_lora import make_lora_adapter
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import varied_prompts
from tests.e2e.test_lora import ADAPTERS
from tests.e2e.tp_utils import SERVER_ARGS, shard_args, start_servers
from tests.utils.live_server import LiveServer

pytest.importorskip("peft")


def _generate_mixed(server: LiveServer, jobs: list[tuple[str, str]]) -> list[pb.Details]:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)

        def call(job: tuple[str, str]) -> pb.Details:
            prompt, adapter = job
            params = pb.GenerateParameters(max_new_tokens=16, details=True, adapter_id=adapter)
            request = pb.GenerateRequest(inputs=[prompt], parameters=params)
            details: pb.Details = stub.Generate(request, timeout=300).results[0].details
            return details

        with ThreadPoolExecutor(len(jobs)) as pool:
            return list(pool.map(call, jobs))


def test_two_shards_match_one_shard_for_mixed_adapters(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    dirs = {
        name: make_lora_adapter(tiny_llama, tmp_path_factory.mktemp(f"tp-{name}"), **kwargs)
        for name, kwargs in ADAPTERS.items()
    }
    lora = ("--lora-adapters", ",".join(f"{n}={p}" for n, p in dirs.items()))
    specs = [(tiny_llama, SERVER_ARGS + lora), (tiny_llama, SERVER_ARGS + lora + shard_args(2))]
    names = [*ADAPTERS, ""]  # "" is the base model
    jobs = [(p, names[i % len(names)]) for i, p in enumerate(varied_prompts(10, seed=5))]
    with start_servers(specs) as (one, two):
        expected = _generate_mixed(one, jobs)
        served = _generate_mixed(two, jobs)
    for job, got, want in zip(jobs, served, expected, strict=True):
        assert [t.id for t in got.tokens] == [t.id for t in want.tokens], job[1]
        assert [t.logprob for t in got.tokens] == pytest.approx(
            [t.logprob for t in want.tokens], abs=1e-3
        )
