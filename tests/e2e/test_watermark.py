"""Issue #15 watermark over real gRPC on the tiny real-weights model: ~200 sampled tokens
with ``watermark`` carry a green-list z-score far above chance; without, it stays near 0."""

from __future__ import annotations

import pytest

from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from genserve.worker.watermark import detect

PROMPT_IDS = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 284]
NUM_TOKENS = 200


def sample(stub: pb_grpc.TextGenerationServiceStub, watermark: bool, seed: int) -> list[int]:
    request = pb.GenerateRequest(
        input_ids=[pb.TokenIds(ids=PROMPT_IDS)],
        parameters=pb.GenerateParameters(
            do_sample=True,
            seed=seed,
            watermark=watermark,
            max_new_tokens=NUM_TOKENS,
            ignore_eos=True,
            details=True,
        ),
    )
    result = stub.Generate(request).results[0]
    assert result.details.generated_tokens == NUM_TOKENS
    return [t.id for t in result.details.tokens]


@pytest.mark.parametrize("seed", [3, 4])
def test_watermark_is_detected(stub: pb_grpc.TextGenerationServiceStub, seed: int) -> None:
    info = stub.Info(pb.InfoRequest())
    vocab, gamma = info.vocab_size, info.watermark_gamma
    marked = detect([PROMPT_IDS[-1], *sample(stub, True, seed)], vocab, gamma)
    plain = detect([PROMPT_IDS[-1], *sample(stub, False, seed)], vocab, gamma)
    assert marked.num_scored == plain.num_scored == NUM_TOKENS
    assert marked.z_score > 4, marked
    assert abs(plain.z_score) < 2, plain
