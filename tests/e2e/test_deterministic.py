"""``--deterministic``: in bfloat16, the same requests give the same tokens and the same
logprobs, bit for bit, alone or in a mixed batch of 8, with prefill chunks of 7, 8 and 16
tokens, and with their prompts' KV from the prefix cache - on real genserve processes over
real gRPC.  Greedy and seeded sampling both."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.testing.tiny_gguf import make_tiny_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.prompts import varied_prompts
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.live_server import LiveServer, start_server

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")

MAX_NEW_TOKENS = 12
SHARED = varied_prompts(8, seed=41)[6]  # ~35 words: several KV blocks
PROMPTS = [
    SHARED,
    f"{SHARED} and then",
    *varied_prompts(6, seed=42, max_words=60),
]
SERVER_ARGS = ("--dtype", "bfloat16", "--deterministic", "--prometheus-port", "0")
Answer = tuple[tuple[int, ...], tuple[float, ...]]


def _params(i: int) -> pb.GenerateParameters:
    """Greedy for most prompts, seeded sampling for every third."""
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    if i % 3 == 2:
        params.do_sample = True
        params.temperature = 0.9
        params.seed = 100 + i
    return params


def _ask(server: LiveServer, i: int) -> Answer:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        reply = stub.Generate(
            pb.GenerateRequest(inputs=[PROMPTS[i]], parameters=_params(i)), timeout=120
        )
    tokens = reply.results[0].details.tokens
    return tuple(t.id for t in tokens), tuple(t.logprob for t in tokens)


def _alone(server: LiveServer) -> list[Answer]:
    return [_ask(server, i) for i in range(len(PROMPTS))]


def _together(server: LiveServer) -> list[Answer]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda i: _ask(server, i), range(len(PROMPTS))))


def _assert_same(expected: Sequence[Answer], got: Sequence[Answer], what: str) -> None:
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        assert have[0] == want[0], f"{what}: prompt {i} tokens differ"
        assert have[1] == want[1], f"{what}: prompt {i} logprobs differ"


def test_output_does_not_depend_on_batching_chunks_or_cache(
    tiny_model_factory: TinyModelFactory,
) -> None:
    model: Path = tiny_model_factory("llama", seed=7)
    with start_server(model, *SERVER_ARGS, "--disable-prefix-caching") as server:
        assert "batch-invariant" in server.logs()
        expected = _alone(server)
        _assert_same(expected, _together(server), "a mixed batch of 8")
    for chunk in (7, 8, 16):
        with start_server(model, *SERVER_ARGS, "--max-batch-prefill-tokens", str(chunk)) as server:
            _assert_same(expected, _together(server), f"prefill chunks of {chunk}")
            # The prompts' full blocks are cached now: the second round reads them.
            _assert_same(expected, _together(server), f"chunks of {chunk}, prefix-cache hits")
            assert _cached_tokens(server) > 0


@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
@pytest.mark.parametrize("weights", ["int4", "Q4_K_M"])
def test_integer_kernels_are_batch_invariant(
    tiny_model_factory: TinyModelFactory, tmp_path: Path, weights: str
) -> None:
    """Quantized weights on the integer path (the default ``--cpu-int-dot auto`` where the CPU
    has one) keep ``--deterministic``'s promise: --quantize int4 (blocks of 32, the integer
    tiles of kernels/int_dot_cpu.cpp) and a Q4_K_M GGUF (K-quant super-blocks and a Q8_0
    embedding, kernels/kquant_cpu.cpp); alone, in a mixed batch, in chunks of 7, from the
    prefix cache."""
    if weights == "int4":
        model: Path = tiny_model_factory("llama", seed=7)
        args: tuple[str, ...] = (*SERVER_ARGS, "--quantize", "int4")
    else:
        model = make_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf", "Q4_K_M", seed=7)
        args = (*SERVER_ARGS, "--genserve-cache", str(fresh_cache(tmp_path)))
    with start_server(model, *args, "--disable-prefix-caching") as server:
        with grpc.insecure_channel(server.address) as channel:
            info = pb_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest())
        assert info.quantized_matmul == "integer", info
        expected = _alone(server)
        _assert_same(expected, _together(server), f"{weights}: a mixed batch of 8")
    with start_server(model, *args, "--max-batch-prefill-tokens", "7") as server:
        _assert_same(expected, _together(server), f"{weights}: prefill chunks of 7")
        _assert_same(expected, _together(server), f"{weights}: chunks of 7, prefix-cache hits")
        assert _cached_tokens(server) > 0


def _cached_tokens(server: LiveServer) -> int:
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        reply = stub.Generate(
            pb.GenerateRequest(inputs=[PROMPTS[1]], parameters=_params(1)), timeout=120
        )
    return int(reply.results[0].details.cached_tokens)
