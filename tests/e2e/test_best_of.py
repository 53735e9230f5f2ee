"""Issue #15 best_of / n over real gRPC on the tiny real-weights model: TGI's best_of
(highest cumulative logprob returned, the others in details.best_of_sequences), n results,
the prompt prefilled once (followers report the shared prompt as cached_tokens), seeds,
refusals, and no KV block leaked."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS
from tests.utils.inproc_server import InProcessServer, inproc_server

BLOCK = 16


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[InProcessServer]:
    with inproc_server(tiny_llama, *PARITY_SERVER_ARGS, "--max-best-of", "4") as srv:
        yield srv


def prompt(tag: str) -> str:
    """A fresh prompt (no prefix-cache hits from other tests) longer than two blocks."""
    return f"{tag}: " + "the quick brown fox jumps over the lazy dog, " * 4


def generate(
    stub: pb_grpc.TextGenerationServiceStub, text: str, **params: Any
) -> pb.GenerateResponse:
    params.setdefault("details", True)
    params.setdefault("max_new_tokens", 12)
    request = pb.GenerateRequest(inputs=[text], parameters=pb.GenerateParameters(**params))
    response: pb.GenerateResponse = stub.Generate(request)
    return response


def logprob_sum(tokens: Any) -> float:
    return sum(t.logprob for t in tokens)


def shared_tokens(input_length: int) -> int:
    return (input_length - 1) // BLOCK * BLOCK


def test_best_of_returns_the_best_sequence(
    server: InProcessServer, stub: pb_grpc.TextGenerationServiceStub
) -> None:
    response = generate(stub, prompt("best"), best_of=3, do_sample=True, seed=5, top_n_tokens=2)
    assert len(response.results) == 1
    best = response.results[0]
    others = best.details.best_of_sequences
    assert len(others) == 2
    best_sum = logprob_sum(best.details.tokens)
    assert all(best_sum >= logprob_sum(o.tokens) for o in others)
    assert sorted([best.details.seed, *(o.seed for o in others)]) == [5, 6, 7]
    texts = {best.generated_text, *(o.generated_text for o in others)}
    assert len(texts) > 1  # different seeds, different samples
    for o in others:
        assert o.generated_tokens == len(o.tokens) == len(o.top_tokens)
        assert o.finish_reason == pb.FINISH_REASON_LENGTH
    # Prefilled once: the first sequence computed the prompt, the others shared its blocks.
    length = best.details.input_length
    cached = sorted([best.details.cached_tokens, *(o.cached_tokens for o in others)])
    assert cached == [0, shared_tokens(length), shared_tokens(length)]
    assert shared_tokens(length) >= 2 * BLOCK
    server.wait_all_blocks_free()


def test_best_of_is_reproducible_with_a_seed(stub: pb_grpc.TextGenerationServiceStub) -> None:
    text = prompt("seeded")
    first = generate(stub, text, best_of=2, do_sample=True, seed=11)
    again = generate(stub, text, best_of=2, do_sample=True, seed=11)
    assert first.results[0].generated_text == again.results[0].generated_text
    assert (
        first.results[0].details.best_of_sequences[0].generated_text
        == again.results[0].details.best_of_sequences[0].generated_text
    )


def test_n_results(server: InProcessServer, stub: pb_grpc.TextGenerationServiceStub) -> None:
    response = generate(stub, prompt("n"), n=3, do_sample=True, seed=1)
    assert [r.details.seed for r in response.results] == [1, 2, 3]  # sequence order
    assert len({r.generated_text for r in response.results}) > 1
    assert not any(r.details.best_of_sequences for r in response.results)
    length = response.results[0].details.input_length
    assert [r.details.cached_tokens for r in response.results] == [0] + [shared_tokens(length)] * 2
    # n with best_of: the n best of best_of, best first.
    response = generate(stub, prompt("nbest"), n=2, best_of=4, do_sample=True, seed=3)
    sums = [logprob_sum(r.details.tokens) for r in response.results]
    assert len(sums) == 2 and sums[0] >= sums[1]
    rest = response.results[0].details.best_of_sequences
    assert len(rest) == 2 and all(sums[1] >= logprob_sum(o.tokens) for o in rest)
    server.wait_all_blocks_free()


def test_greedy_n_gives_identical_results(stub: pb_grpc.TextGenerationServiceStub) -> None:
    text = prompt("greedy")
    single = generate(stub, text).results[0].generated_text
    response = generate(stub, text, n=2)
    assert [r.generated_text for r in response.results] == [single, single]


def test_batch_of_inputs_with_n(stub: pb_grpc.TextGenerationServiceStub) -> None:
    request = pb.GenerateRequest(
        inputs=[prompt("x"), prompt("y")],
        parameters=pb.GenerateParameters(n=2, do_sample=True, seed=4, max_new_tokens=4),
    )
    response = stub.Generate(request)
    assert len(response.results) == 4  # n per input, input order


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"best_of": 2}, "sampling"),
        ({"best_of": 5, "do_sample": True}, "--max-best-of"),
        ({"n": 5}, "--max-best-of"),
        ({"best_of": 2, "n": 3, "do_sample": True}, "must be >= `n`"),
        ({"best_of": 0}, "strictly positive"),
    ],
)
def test_refusals(
    stub: pb_grpc.TextGenerationServiceStub, params: dict[str, Any], needle: str
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, "hi", **params)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


@pytest.mark.parametrize("params", [{"best_of": 2, "do_sample": True}, {"n": 2}])
def test_streaming_refused(stub: pb_grpc.TextGenerationServiceStub, params: dict[str, Any]) -> None:
    request = pb.GenerateStreamRequest(inputs="hi", parameters=pb.GenerateParameters(**params))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.GenerateStream(request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_info_reports_the_limit(stub: pb_grpc.TextGenerationServiceStub) -> None:
    info = stub.Info(pb.InfoRequest())
    assert info.max_best_of == 4
    assert (info.watermark_gamma, info.watermark_delta) == (0.5, 2.0)
