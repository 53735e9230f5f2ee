"""GGUF files served as they are stored, over gRPC, against transformers' generate() on the
same file (transformers dequantizes it with gguf-py; float32): Q4_0 matrices through
genserve's quantized kernels; Q4_K_M and Q5_K_M mixes through the K-quant kernel
(kernels/kquant_cpu.cpp) on its float path, the fused Q/K/V mixing Q4_K (or Q5_K) with Q6_K,
greedy tokens equal; and the Q4_K_M mix on the integer path (``--cpu-int-dot on``), where the
int8 activations move the logits a little, so agreement is stated and bounded instead."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.model.loader import resolve_model
from genserve.testing.tiny_gguf import make_tiny_gguf
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.e2e.test_gguf_restart import fresh_cache
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
@pytest.mark.parametrize("preset", ["Q4_0", "Q4_K_M", "Q5_K_M"])
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
    if preset != "Q4_0":  # K matrices kept packed: ~5-7 bits per weight, not the model dtype
        float_bytes = 4 * _parameter_count(model)
        assert info.model_weight_bytes < float_bytes / 3
    entry = resolve_model(str(model), cache_dir=cache / "models").local_dir
    assert not list(entry.glob("*.safetensors"))  # no float copy of the file was cached
    expected = hf_greedy(entry, prompts, 12)
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids, f"prompt {prompt[:40]!r}"
        got = [t.logprob for t in result.details.tokens]
        assert got == pytest.approx(logprobs, abs=1e-3)


def _parameter_count(model: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(model).tensors)


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _bf16_native() -> bool:
    import torch

    return cpu_kernels.load() and bool(torch.ops.genserve.bf16_gemm_native())


INT_PROMPTS = varied_prompts(6, seed=5)
INT_NEW_TOKENS = 12


@dataclass(frozen=True)
class KQuantReference:
    """The Q4_K_M file of the integer-path tests and transformers' greedy tokens on it."""

    model: Path
    expected: list[list[int]]


@pytest.fixture(scope="module")
def k_quant_reference(tmp_path_factory: pytest.TempPathFactory) -> KQuantReference:
    """Made once for the three prompt paths: the file (seeded, so the same every time) and
    its transformers reference (the same prompts and length) do not depend on the path, and
    loading the file in transformers parses its vocabulary twice (~8 s).  Read-only: each
    test serves the file from a fresh cache of its own."""
    root = tmp_path_factory.mktemp("k-quant-reference")
    model = make_tiny_gguf(root / "tiny-Q4_K_M.gguf", "Q4_K_M", seed=7)
    entry = resolve_model(str(model), cache_dir=fresh_cache(root) / "models").local_dir
    expected = [ids for ids, _ in hf_greedy(entry, INT_PROMPTS, INT_NEW_TOKENS)]
    return KQuantReference(model, expected)


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
@pytest.mark.parametrize(
    "prompt_path",
    [
        "integer",
        pytest.param(
            "bf16",
            marks=pytest.mark.skipif(
                not _bf16_native(), reason="no native bfloat16 GEMM (AVX512-BF16 / AMX-BF16)"
            ),
        ),
        "int-gemm",
    ],
)
def test_k_quants_on_the_integer_path_agree_with_transformers(
    tmp_path: Path,
    prompt_path: str,
    monkeypatch: pytest.MonkeyPatch,
    k_quant_reference: KQuantReference,
) -> None:
    """Q4_K_M with ``--cpu-int-dot on``: K-quant and Q8_0 matrices multiplied by int8
    activations.  Stated agreement (docs/cpu/integer-kernels.md): at least half of all greedy
    tokens come before a prompt's first divergence from transformers' float32 tokens (measured
    on this file: prefixes [12, 12, 12, 1, 12, 10] of 12, 82%; a random tiny model's logits
    are flat, so a near-tie can flip the very first token of a prompt).  ``bf16``: every
    prompt step of 2 rows or more takes the many-row path (K-quants decoded to bfloat16,
    kernels/prefill_gemm.py) as long prompts do; the same bound holds.  ``int-gemm``: the
    server told the CPU has AVX2 only (``--cpu-features-mask avx2``), so every prompt step of
    2 rows or more takes the register-tiled integer GEMM of CPUs without bfloat16
    (kernels/prefill_int_gemm_cpu.cpp); the same bound holds."""
    from genserve.kernels import prefill_gemm

    monkeypatch.setenv(prefill_gemm.ENV_MIN_ROWS, "2" if prompt_path == "bf16" else "0")
    monkeypatch.setenv(prefill_gemm.ENV_INT_GEMM_MIN_ROWS, "2")
    mask = ("--cpu-features-mask", "avx2") if prompt_path == "int-gemm" else ()
    model = k_quant_reference.model
    cache = fresh_cache(tmp_path)
    prompts = INT_PROMPTS
    new_tokens = INT_NEW_TOKENS
    params = pb.GenerateParameters(max_new_tokens=new_tokens, details=True)
    args = (*PARITY_SERVER_ARGS, "--genserve-cache", str(cache), "--cpu-int-dot", "on", *mask)
    try:
        with (
            inproc_server(model, *args) as server,
            grpc.insecure_channel(server.address) as channel,
        ):
            stub = pb_grpc.TextGenerationServiceStub(channel)
            served = [
                [
                    t.id
                    for t in stub.Generate(pb.GenerateRequest(inputs=[p], parameters=params))
                    .results[0]
                    .details.tokens
                ]
                for p in prompts
            ]
    finally:  # the in-process server's mask must not outlive it in this test process
        cpu_kernels._settings.hidden_features = ()
        torch.ops.genserve.set_hidden_cpu_features([])
    expected = k_quant_reference.expected
    prefixes = [_agreeing_prefix(a, b) for a, b in zip(served, expected, strict=True)]
    print(f"integer path: agreeing prefixes {prefixes} of {new_tokens}")
    assert sum(prefixes) >= 0.5 * new_tokens * len(prompts), prefixes
    assert prefixes.count(new_tokens) >= len(prompts) // 2, prefixes  # most agree throughout


@pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
def test_f16_gguf_in_float32_keeps_float16_panels_and_matches_transformers(
    tmp_path: Path,
) -> None:
    """An F16 file served in float32 (``--dtype float32``, as CPUs without native bfloat16
    are by default): its matrices go to float16 panels (``weight_panels.pack_half_exact``),
    so the weights take about 2 bytes a parameter instead of 4, and greedy tokens and
    logprobs still equal transformers' float32 ones (the panels widen exactly)."""
    model = make_tiny_gguf(tmp_path / "tiny-F16.gguf", "F16", seed=7)
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
    # float32 panels would be >= 4 bytes a parameter; the norms stay float32 (a few KB)
    assert info.model_weight_bytes < 2.5 * _parameter_count(model)
    entry = resolve_model(str(model), cache_dir=cache / "models").local_dir
    expected = hf_greedy(entry, prompts, 12)
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids, f"prompt {prompt[:40]!r}"
        got = [t.logprob for t in result.details.tokens]
        assert got == pytest.approx(logprobs, abs=1e-3)
