"""GGUF files of non-Llama native families, written as llama.cpp's ``convert_hf_to_gguf.py``
writes them (``genserve.testing.family_gguf``: its tensor names, Q/K row order, Gemma's
``w + 1`` norms, Phi-3's fused matrices and longrope factor tensors, and the metadata keys
transformers' GGUF reader drops), served over gRPC natively: greedy tokens equal transformers
``generate()`` on the float32 checkpoint the file was made from, logprobs within 1e-3.

The tiny checkpoints keep what llama.cpp assumes where the file has no key for it: Gemma's
query scale is ``head_dim`` (``query_pre_attn_scalar``), Gemma 3 has five sliding layers per
global one.  Mistral is written as ``llama`` (Q/K permuted), the path
``test_gguf_serving.py`` covers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest

from genserve.model.loader import resolve_model
from genserve.testing.family_gguf import make_family_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.conftest import TinyModelFactory
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server

MAX_NEW_TOKENS = 12
# What llama.cpp assumes for Gemma 2/3 (src/models/gemma{2,3}.cpp; head_dim 16 here).
_LLAMA_CPP_ASSUMES: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": {
        "query_pre_attn_scalar": 16,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    },
}
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def _with_tokenizer_of(gguf_file: Path, cache: Path, model_dir: Path, tmp_path: Path) -> Path:
    """``model_dir``'s weights and config with the tokenizer the server read from the GGUF
    file: transformers picks its GGUF tokenizer converter by architecture (Gemma's for
    ``gemma2``/``gemma3``), which on this file's borrowed GPT-2 vocabulary tokenizes
    otherwise than the checkpoint's own tokenizer; the comparison is of the model."""
    entry = resolve_model(str(gguf_file), cache_dir=cache / "models").local_dir
    reference = tmp_path / "reference"
    reference.mkdir()
    for source in (entry, model_dir):
        for item in source.iterdir():
            is_model = item.name == "config.json" or item.suffix == ".safetensors"
            if is_model == (source == model_dir) and not (reference / item.name).exists():
                shutil.copy(item, reference / item.name)
    return reference


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_family_gguf_matches_transformers(
    family: str, tiny_model_factory: TinyModelFactory, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory(family, seed=2, **_LLAMA_CPP_ASSUMES.get(family, {}))
    gguf_file = make_family_gguf(tmp_path / f"{family}.gguf", model_dir, family)
    # Two shorter and two longer than the 32-token sliding windows and Phi-3's 128-token
    # original context.
    prompts = [varied_prompts(12, seed=7)[i] for i in (0, 4, 9, 11)]
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    cache = fresh_cache(tmp_path)
    with (
        inproc_server(gguf_file, *PARITY_SERVER_ARGS, "--genserve-cache", str(cache)) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        served = [
            stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params)).results[0]
            for p in prompts
        ]
    assert (info.architecture, info.implementation) == (ARCHITECTURES[family], "native")
    assert max(r.details.input_length for r in served) > 128
    expected = hf_greedy(_with_tokenizer_of(gguf_file, cache, model_dir, tmp_path), prompts,
                         MAX_NEW_TOKENS)  # fmt: skip
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids, (family, prompt[:40])
        got = [t.logprob for t in result.details.tokens]
        assert got == pytest.approx(logprobs, abs=1e-3)
