"""GGUF files served as they are stored, over gRPC, against transformers' generate() on the
same file (transformers dequantizes it with gguf-py; float32): Q4_0 matrices through
genserve's quantized kernels, a Q4_K_M mix (K-quants dequantized tensor by tensor at load,
its Q8_0 embedding kept) through the float path."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.model.loader import resolve_model
from genserve.testing.tiny_gguf import make_tiny_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
@pytest.mark.parametrize("preset", ["Q4_0", "Q4_K_M"])
def test_gguf_served_as_stored_matches_transformers(tmp_path: Path, preset: str) -> None:
    model = make_tiny_gguf(tmp_path / f"tiny-{preset}.gguf", preset, seed=7)
    cache = fresh_cache(tmp_path)
    prompts = varied_prompts(4, seed=3)
    params = pb.GenerateParameters(max_new_tokens=12, details=True)
    with (
        inproc_server(model, *PARITY_SERVER_ARGS, "--genserve-cache", str(cache)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        served = [
            stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params)).results[0]
            for p in prompts
        ]
    assert info.quantize == "gguf"
    entry = resolve_model(str(model), cache_dir=cache / "models").local_dir
    assert not list(entry.glob("*.safetensors"))  # no float copy of the file was cached
    expected = hf_greedy(entry, prompts, 12)
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids, f"prompt {prompt[:40]!r}"
        got = [t.logprob for t in result.details.tokens]
        assert got == pytest.approx(logprobs, abs=1e-3)
