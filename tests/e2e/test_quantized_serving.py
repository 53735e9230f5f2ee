"""``--quantize`` served over gRPC.

* int8 / int4 on a tiny Llama: greedy tokens and logprobs equal transformers' ``generate()``
  on the *dequantized* weights (the same quantizer, then float32): the server computes with
  exactly the quantized matrices, whatever path (registers, scratch, GEMM) a step takes.
* gguf (the default for a .gguf model on CPU) on the embedded default model: its Q4_1/Q8_0
  blocks served as they are give the same greedy tokens as the float32 weights transformers
  dequantizes from the same file (``--quantize none``).

All on the float path (``--cpu-int-dot off``, PARITY_SERVER_ARGS): the integer kernels, the
default where the CPU has them, round activations to int8 and are held to an agreement bound
instead (tests/e2e/test_int_dot_serving.py, test_gguf_serving.py).
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from genserve.kernels import cpu as cpu_kernels
from genserve.model.loader import ResolvedModel, default_gguf_path
from genserve.model.quantization import QuantizationError, quantize, quantize_int8
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from genserve.worker.model_runner import ModelRunner
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.e2e.test_tensor_parallel import generate_all
from tests.e2e.tp_utils import SERVER_ARGS, shard_args, start_servers
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server
from tests.utils.live_server import start_server

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _dequantized_copy(model_dir: Path, out: Path, method: str) -> Path:
    """``model_dir`` with every matrix replaced by its ``method`` round trip, as genserve
    quantizes them (projections per method, the tied embedding int8 per-channel)."""
    shutil.copytree(model_dir, out)
    (weights_file,) = out.glob("*.safetensors")
    tensors = load_file(str(weights_file))
    for name, tensor in tensors.items():
        if any(f".{p}.weight" in name for p in _PROJECTIONS):
            tensors[name] = quantize(tensor, method).dequantize()
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensors[name] = quantize_int8(tensor).dequantize()
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_greedy_matches_transformers_on_dequantized_weights(
    tiny_llama: Path, tmp_path: Path, method: str
) -> None:
    prompts = varied_prompts(8, seed=11)
    with (
        inproc_server(tiny_llama, *PARITY_SERVER_ARGS, "--quantize", method) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        params = pb.GenerateParameters(max_new_tokens=24, details=True)

        def call(prompt: str) -> pb.GenerateResult:
            request = pb.GenerateRequest(inputs=[prompt], parameters=params)
            return stub.Generate(request).results[0]

        with ThreadPoolExecutor(len(prompts)) as pool:  # shared steps of 1..8 rows + prefills
            served = list(pool.map(call, prompts))
    assert info.quantize == method
    (weights_file,) = tiny_llama.glob("*.safetensors")
    float_bytes = sum(t.nbytes for t in load_file(str(weights_file)).values())
    assert 0 < info.model_weight_bytes < float_bytes * (0.4 if method == "int8" else 0.3)
    reference = _dequantized_copy(tiny_llama, tmp_path / "dequantized", method)
    expected = hf_greedy(reference, prompts, 24)
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids, f"prompt {prompt[:40]!r}"
        got = [t.logprob for t in result.details.tokens]
        assert got == pytest.approx(logprobs, abs=1e-3)


def test_gguf_method_needs_a_gguf_model(tiny_llama: Path) -> None:
    model = ResolvedModel(tiny_llama, "tiny", quantize="gguf")
    with pytest.raises(QuantizationError, match=r"not loaded from a \.gguf file"):
        ModelRunner(model, torch.float32, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.skipif(
    not cpu_kernels.load(), reason="CPU kernels did not build: a .gguf model is dequantized"
)
def test_gguf_blocks_serve_the_default_model_like_its_float_weights() -> None:
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    params = pb.GenerateParameters(max_new_tokens=24, details=True)
    outputs: dict[str, list[list[int]]] = {}
    infos: dict[str, pb.InfoResponse] = {}
    # Unset, --quantize is gguf for a .gguf model on CPU: the second server, on the float path
    # (the integer kernels' agreement is tests/e2e/test_int_dot_serving.py's).
    for label, extra in (("float32", ("--quantize", "none")), ("gguf", ("--cpu-int-dot", "off"))):
        with (
            start_server(
                str(default_gguf_path()),
                "--dtype",
                "float32",
                "--max-batch-total-tokens",
                "4096",
                "--prometheus-port",
                "0",
                *extra,
            ) as server,  # fmt: skip
            grpc.insecure_channel(server.address) as channel,
        ):
            stub = pb_grpc.TextGenerationServiceStub(channel)
            infos[label] = stub.Info(pb.InfoRequest())
            outputs[label] = [
                [
                    t.id
                    for t in stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params))
                    .results[0]
                    .details.tokens
                ]
                for p in prompts
            ]
    assert outputs["gguf"] == outputs["float32"]
    assert infos["gguf"].quantize == "gguf" and infos["float32"].quantize == ""
    assert infos["gguf"].quantized_matmul == "float" and infos["float32"].quantized_matmul == ""
    # Q4_1 layers and a Q8_0 embedding: about a fifth of the float32 bytes.
    ratio = infos["gguf"].model_weight_bytes / infos["float32"].model_weight_bytes
    assert ratio < 0.3


def test_two_shards_serve_int4_like_transformers_on_dequantized_weights(
    tiny_llama: Path, tmp_path: Path
) -> None:
    # Each shard quantizes its own slice: the row-parallel projections are split on input
    # features at a multiple of 32, so the groups, and the result, are those of one shard.
    prompts = varied_prompts(6, seed=5)
    with start_servers([(tiny_llama, (*SERVER_ARGS, *shard_args(2), "--quantize", "int4"))]) as (
        server,
    ):
        served = generate_all(server, prompts, 16)
    expected = hf_greedy(_dequantized_copy(tiny_llama, tmp_path / "ref", "int4"), prompts, 16)
    for prompt, got, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in got.tokens] == ids, f"prompt {prompt[:40]!r}"
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs, abs=1e-3)
