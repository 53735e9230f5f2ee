"""gpt-oss GGUF files (issue #26) served natively over real gRPC, their routed experts kept in
the file's blocks — MXFP4 as llama.cpp's converter writes the released checkpoints, Q8_0, or
F32 — through ``genserve::moe_experts_gguf`` with gpt-oss's expert biases and clamped SwiGLU.

The file is written in the converter's layout (``genserve.testing.gpt_oss_gguf``: split
gate/up stacks, expert and router biases, ``attn_sinks``, ``post_attention_norm``, the YaRN
and sliding-window keys) from a tiny random-weight float32 gpt-oss (8 experts, top-2,
sliding and full layers alternating, sinks).  Its SwiGLU limit is llama.cpp's 7.0 (a GGUF
file has no key for it) and its expert biases are drawn wide (N(0, 4)) so that the clamp is
reached.  The reference is transformers ``generate()`` (float32) on the checkpoint with
every weight as gguf-py dequantizes it from the file."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.testing.gpt_oss_gguf import write_gpt_oss_gguf
from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.e2e.test_family_gguf import _with_tokenizer_of
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server
from tests.utils.moe_models import make_moe_model

MAX_NEW_TOKENS = 12
# A short prompt and two longer than the 16-token sliding window.
PROMPTS = [varied_prompts(12, seed=7)[i] for i in (0, 4, 9)]

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


def _gpt_oss(tmp_path: Path) -> Path:
    """The tiny gpt-oss with llama.cpp's SwiGLU limit and wide expert biases."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = make_moe_model(
        tmp_path / "gpt_oss", "gpt_oss", default_tokenizer_dir(), seed=4, swiglu_limit=7.0
    )
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(9)
    for name, value in tensors.items():
        if name.endswith("gate_up_proj_bias"):
            tensors[name] = 4.0 * torch.randn(value.shape, generator=gen)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def _serve(gguf: Path, cache: Path, *extra: str) -> tuple[pb.InfoResponse, list[list[pb.Token]]]:
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    args = (*PARITY_SERVER_ARGS, "--genserve-cache", str(cache), *extra)
    with inproc_server(gguf, *args) as server, grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        served = [
            list(stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params)).results[0]
                 .details.tokens)
            for p in PROMPTS
        ]  # fmt: skip
    return info, served


@needs_kernels
@pytest.mark.parametrize(
    ("experts", "matrices"), [("MXFP4", "Q8_0"), ("Q8_0", "Q8_0"), ("F32", "F32")]
)
def test_gpt_oss_gguf_matches_transformers(experts: str, matrices: str, tmp_path: Path) -> None:
    """Float path (``--cpu-int-dot off``): greedy tokens equal, logprobs within 1e-3;
    ``Info`` native; quantized experts held in their blocks (MXFP4: 4.25 bits a weight)."""
    gguf, reference = write_gpt_oss_gguf(
        tmp_path / f"gpt-oss-{experts}.gguf", _gpt_oss(tmp_path), experts, matrices
    )
    cache = fresh_cache(tmp_path)
    info, served = _serve(gguf, cache)
    assert (info.architecture, info.implementation) == ("GptOssForCausalLM", "native")
    if experts != "F32":
        assert info.quantize == "gguf"
        assert info.model_weight_bytes < 4 * _parameter_count(gguf) / 3
    expected = hf_greedy(_with_tokenizer_of(gguf, cache, reference, tmp_path), PROMPTS,
                         MAX_NEW_TOKENS)  # fmt: skip
    for prompt, tokens, (ids, logprobs) in zip(PROMPTS, served, expected, strict=True):
        assert [t.id for t in tokens] == ids, (experts, prompt[:40])
        assert [t.logprob for t in tokens] == pytest.approx(logprobs, abs=1e-3)


def _parameter_count(gguf: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)


@needs_kernels
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
def test_gpt_oss_mxfp4_integer_path_agrees(tmp_path: Path) -> None:
    """``--cpu-int-dot on``: MXFP4 experts on int8 activations (Q8_0 per 32 inputs, as
    llama.cpp's ``ggml_vec_dot_mxfp4_q8_0``).  Stated agreement with the float32 reference:
    every prompt's first token's logprob within 0.1 of the reference's, and at least half of
    all greedy tokens before a prompt's first divergence."""
    gguf, reference = write_gpt_oss_gguf(
        tmp_path / "gpt-oss-MXFP4.gguf", _gpt_oss(tmp_path), "MXFP4", "Q8_0"
    )
    cache = fresh_cache(tmp_path)
    _, served = _serve(gguf, cache, "--cpu-int-dot", "on")
    expected = hf_greedy(_with_tokenizer_of(gguf, cache, reference, tmp_path), PROMPTS,
                         MAX_NEW_TOKENS)  # fmt: skip
    prefixes = []
    for tokens, (ids, _) in zip(served, expected, strict=True):
        got = [t.id for t in tokens]
        prefixes.append(
            next((i for i, (a, b) in enumerate(zip(got, ids, strict=False)) if a != b), len(ids))
        )
    first = [tokens[0].logprob for tokens in served]
    print(f"integer path, gpt-oss MXFP4 experts: agreeing prefixes {prefixes} of "
          f"{MAX_NEW_TOKENS}, first logprobs {first}")  # fmt: skip
    assert first == pytest.approx([logprobs[0] for _, logprobs in expected], abs=0.1)
    assert sum(prefixes) >= 0.5 * MAX_NEW_TOKENS * len(PROMPTS), prefixes


@needs_kernels
def test_gpt_oss_released_mxfp4_checkpoint_is_native(tmp_path: Path) -> None:
    """The released checkpoints' format (``quantization_config: mxfp4``, ``*_blocks`` /
    ``*_scales``): served natively, its experts rearranged into GGML MXFP4 blocks at load
    (``model/mxfp4.py``) and run by the quantized expert op; greedy tokens equal
    transformers on the dequantized float checkpoint, logprobs within 1e-3 (float path)."""
    from genserve.testing.gpt_oss_gguf import write_gpt_oss_mxfp4_checkpoint

    model_dir, reference = write_gpt_oss_mxfp4_checkpoint(tmp_path / "mxfp4", _gpt_oss(tmp_path))
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)
    cache = fresh_cache(tmp_path)
    args = (*PARITY_SERVER_ARGS, "--genserve-cache", str(cache))
    with inproc_server(model_dir, *args) as server, grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.TextGenerationServiceStub(ch)
        info = stub.Info(pb.InfoRequest())
        served = [
            list(stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params)).results[0]
                 .details.tokens)
            for p in PROMPTS
        ]  # fmt: skip
    assert (info.architecture, info.implementation) == ("GptOssForCausalLM", "native")
    expected = hf_greedy(reference, PROMPTS, MAX_NEW_TOKENS)
    for prompt, tokens, (ids, logprobs) in zip(PROMPTS, served, expected, strict=True):
        assert [t.id for t in tokens] == ids, prompt[:40]
        assert [t.logprob for t in tokens] == pytest.approx(logprobs, abs=1e-3)
