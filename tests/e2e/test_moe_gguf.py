"""Mixture-of-experts GGUF files (issue #26) served natively over real gRPC, their routed
experts kept in the file's blocks (``genserve::moe_experts_gguf``, kernels/moe_quant_cpu.cpp).

The files are written as llama.cpp's converter writes Qwen2/3-MoE and Mixtral (stacked
``ffn_{gate,up,down}_exps``, ``ffn_gate_inp``, Qwen2-MoE's ``ffn_*_shexp``; Mixtral as
architecture ``llama`` with ``llama.expert_count`` and permuted Q/K rows, its config read
back as Mixtral's; ``genserve.testing.moe_gguf``), from tiny random-weight checkpoints (8
experts, top-2).  The
reference is transformers ``generate()`` (float32) on the checkpoint with every weight as
gguf-py dequantizes it from the file: an F32 file's are the checkpoint's own.  On the float
path (``--cpu-int-dot off``, in PARITY_SERVER_ARGS) greedy tokens are equal and logprobs
within 1e-3, for F32, Q8_0 and Q4_0 experts and a Q4_K_M-like mix (Q4_K gate/up, Q6_K down); with
``--cpu-int-dot on`` the int8 activations move the logits, so agreement is bounded instead,
as for dense K-quant files (tests/e2e/test_gguf_serving.py)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.testing.moe_gguf import write_moe_gguf
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
PROMPTS = [varied_prompts(12, seed=7)[i] for i in (0, 4, 9)]
# K-quants take super-blocks of 256 along every row: hidden and expert width 256.
K_SHAPE = {"hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64}
ARCHITECTURES = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


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


# Every layer a MoE layer: llama.cpp's qwen2moe/qwen3moe graphs have no dense layers.
# Mixtral: no sliding window (llama.cpp's ``llama`` graph has none, and the converter writes
# none), and an expert width of whole Q8_0/Q4_0 blocks (the down projection's rows).
_LLAMA_CPP_ASSUMES: dict[str, dict[str, object]] = {
    "qwen3_moe": {"mlp_only_layers": []},
    "mixtral": {"sliding_window": None, "intermediate_size": 64},
}
# The Mixtral family's expert width is ``intermediate_size``.
_K_SHAPE_NAMES = {"mixtral": {"moe_intermediate_size": "intermediate_size"}}


def _model(tmp_path: Path, family: str, **shape: int) -> Path:
    rename = _K_SHAPE_NAMES.get(family, {})
    shape = {rename.get(k, k): v for k, v in shape.items()}
    overrides = {**_LLAMA_CPP_ASSUMES.get(family, {}), **shape}
    return make_moe_model(tmp_path / family, family, default_tokenizer_dir(), seed=4, **overrides)


@needs_kernels
@pytest.mark.parametrize(
    ("family", "experts", "matrices"),
    [
        ("qwen3_moe", "F32", "F32"),
        ("qwen3_moe", "Q8_0", "Q8_0"),
        ("qwen3_moe", "Q4_0", "Q8_0"),
        ("qwen3_moe", "Q4_K_M", "Q8_0"),
        ("qwen2_moe", "F32", "F32"),
        ("qwen2_moe", "Q8_0", "Q8_0"),
        ("mixtral", "F32", "F32"),
        ("mixtral", "Q8_0", "Q8_0"),
        ("mixtral", "Q4_K_M", "Q8_0"),
    ],
)
def test_moe_gguf_matches_transformers(
    family: str, experts: str, matrices: str, tmp_path: Path
) -> None:
    model_dir = _model(tmp_path, family, **(K_SHAPE if experts == "Q4_K_M" else {}))
    gguf, reference = write_moe_gguf(
        tmp_path / f"{family}-{experts}.gguf", model_dir, experts, matrices
    )
    cache = fresh_cache(tmp_path)
    info, served = _serve(gguf, cache)
    assert (info.architecture, info.implementation) == (ARCHITECTURES[family], "native")
    if experts != "F32":
        assert info.quantize == "gguf"
        # every matrix in its blocks (8.5 bits or fewer a weight), none in float32
        assert info.model_weight_bytes < 4 * _parameter_count(gguf) / 3
    expected = hf_greedy(_with_tokenizer_of(gguf, cache, reference, tmp_path), PROMPTS,
                         MAX_NEW_TOKENS)  # fmt: skip
    for prompt, tokens, (ids, logprobs) in zip(PROMPTS, served, expected, strict=True):
        assert [t.id for t in tokens] == ids, (family, experts, prompt[:40])
        assert [t.logprob for t in tokens] == pytest.approx(logprobs, abs=1e-3)


def _parameter_count(gguf: Path) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)


def _agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@needs_kernels
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
@pytest.mark.parametrize(
    ("family", "experts"), [("qwen3_moe", "Q8_0"), ("qwen3_moe", "Q4_K_M"), ("mixtral", "Q8_0")]
)
def test_moe_gguf_integer_path_agrees(family: str, experts: str, tmp_path: Path) -> None:
    """``--cpu-int-dot on``: experts multiplied on int8 activations (Q8_0 per 32 inputs for
    Q8_0 blocks, Q8_K per 256 for K-quants).  Stated agreement with the float32 reference on
    the dequantized weights: every prompt's first token's logprob within 0.1 of the
    reference's (the first token is computed on the same input either way; where int8
    rounding flips a near-tie the two candidates' logprobs are that close too), and for
    Qwen3-MoE, as for dense K-quant files, at least half of all greedy tokens come before a
    prompt's first divergence.  The tiny Mixtral (no q/k norm) has near-ties that the
    dense projections' int8 activations alone flip: with F32 experts and Q8_0 attention it
    diverges at the same tokens (prefixes 12, 1, 2 of 12), so only the first check applies
    to it."""
    model_dir = _model(tmp_path, family, **(K_SHAPE if experts == "Q4_K_M" else {}))
    gguf, reference = write_moe_gguf(tmp_path / f"{family}-{experts}.gguf", model_dir, experts,
                                     "Q8_0")  # fmt: skip
    cache = fresh_cache(tmp_path)
    _, served = _serve(gguf, cache, "--cpu-int-dot", "on")
    expected = hf_greedy(_with_tokenizer_of(gguf, cache, reference, tmp_path), PROMPTS,
                         MAX_NEW_TOKENS)  # fmt: skip
    prefixes = [
        _agreeing_prefix([t.id for t in tokens], ids)
        for tokens, (ids, _) in zip(served, expected, strict=True)
    ]
    first = [tokens[0].logprob for tokens in served]
    print(f"integer path, {family} {experts} experts: agreeing prefixes {prefixes} of "
          f"{MAX_NEW_TOKENS}, first logprobs {first}")  # fmt: skip
    assert first == pytest.approx([logprobs[0] for _, logprobs in expected], abs=0.1)
    if family != "mixtral":
        assert sum(prefixes) >= 0.5 * MAX_NEW_TOKENS * len(PROMPTS), prefixes
