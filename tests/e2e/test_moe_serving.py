"""The native mixture-of-experts families (issue #26) served over real gRPC from tiny
random-weight float32 checkpoints (8 experts, top-2; tests/utils/moe_models.py), with
concurrent prompts of a few to ~300 words: greedy tokens equal transformers
``generate()``, logprobs within 1e-3, and ``Info`` says the model runs natively.  Served on
one shard (the CPU kernels' ``genserve::moe_experts`` op, one op per MoE layer) and on two
(every expert's width split between the shards, or with ``--expert-parallel`` whole
experts per shard).

``tests/unit/test_moe.py`` checks that the routing features and shared experts each change
the reference, so these comparisons prove each is implemented."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server
from tests.utils.moe_models import MOE_FAMILIES, make_moe_model

MAX_NEW_TOKENS = 16
PROMPTS = [varied_prompts(12, seed=7)[i] for i in (0, 4, 6, 9)]


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-serving")
    tok = default_tokenizer_dir()
    return {f: make_moe_model(root / f, f, tok, seed=4) for f in MOE_FAMILIES}


def _served(stub: pb_grpc.TextGenerationServiceStub) -> list[pb.Details]:
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)

    def call(prompt: str) -> pb.Details:
        request = pb.GenerateRequest(inputs=[prompt], parameters=params)
        details: pb.Details = stub.Generate(request, timeout=300).results[0].details
        return details

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(call, PROMPTS))


def _check(family: str, model_dir: Path, served: list[pb.Details]) -> None:
    assert max(d.input_length for d in served) > 200
    expected = hf_greedy(model_dir, PROMPTS, MAX_NEW_TOKENS)
    for prompt, got, (ids, logprobs) in zip(PROMPTS, served, expected, strict=True):
        assert [t.id for t in got.tokens] == ids, (family, prompt[:40])
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_moe_family_matches_transformers(family: str, moe_dirs: dict[str, Path]) -> None:
    model_dir = moe_dirs[family]
    with inproc_server(model_dir, *PARITY_SERVER_ARGS) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            info = stub.Info(pb.InfoRequest())
            served = _served(stub)
        server.wait_all_blocks_free()
    assert info.implementation == "native"
    config = json.loads((model_dir / "config.json").read_text())
    assert info.architecture == config["architectures"][0]
    _check(family, model_dir, served)


def test_expert_parallel_shards_match_transformers(moe_dirs: dict[str, Path]) -> None:
    """``--expert-parallel``: Qwen3-MoE's 8 experts as 4 whole experts per shard (its
    first layer dense, split by tensor parallelism as usual)."""
    from tests.e2e.test_tensor_parallel import generate_all
    from tests.e2e.tp_utils import SERVER_ARGS, shard_args, start_servers

    model_dir = moe_dirs["qwen3_moe"]
    args = (*SERVER_ARGS, *shard_args(2), "--expert-parallel")
    with start_servers([(model_dir, args)]) as (server,):
        served = generate_all(server, PROMPTS, MAX_NEW_TOKENS)
    _check("qwen3_moe", model_dir, served)


def test_gpt_oss_chunked_prefill_and_prefix_hits(moe_dirs: dict[str, Path]) -> None:
    """gpt-oss's sinks and sliding layers through prompts prefilled 48 tokens a step, then
    the same prompts again (their blocks from the prefix cache, the rest computed)."""
    model_dir = moe_dirs["gpt_oss"]
    args = (*PARITY_SERVER_ARGS, "--chunked-prefill-size", "48")
    with inproc_server(model_dir, *args) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            first = _served(stub)
            again = _served(stub)
        server.wait_all_blocks_free()
    _check("gpt_oss", model_dir, first)
    _check("gpt_oss", model_dir, again)


# Two shards: Qwen2-MoE (gated shared expert split like a dense MLP), GLM-4-MoE (grouped
# sigmoid routing, dense first layer, partial rotary) and gpt-oss (sinks split by query head,
# expert biases: the down bias added by one shard).
@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe", "gpt_oss"])
def test_two_shards_match_transformers(family: str, moe_dirs: dict[str, Path]) -> None:
    from tests.e2e.test_tensor_parallel import generate_all
    from tests.e2e.tp_utils import SERVER_ARGS, shard_args, start_servers

    model_dir = moe_dirs[family]
    with start_servers([(model_dir, SERVER_ARGS + shard_args(2))]) as (server,):
        served = generate_all(server, PROMPTS, MAX_NEW_TOKENS)
    _check(family, model_dir, served)
