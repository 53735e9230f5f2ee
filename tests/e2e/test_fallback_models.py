"""The transformers fallback (issue #25/#26): every architecture genserve does not implement
natively is served through transformers' modeling code with genserve's paged KV cache and
continuous batching, and gives transformers' own greedy output.  The checkpoints of the
families that are native now (``NATIVE``, model/families) must take the native path and
give the same output.

Per architecture (tests/e2e/fallback_models.py): a tiny random-weight checkpoint, one real
server over real gRPC, prompts sent concurrently (they share steps; most are longer than the
sliding window / attention chunk), greedy tokens equal to ``generate()`` on the same float32
weights, logprobs within 1e-3, and ``Info`` naming the architecture and the path it takes.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.fallback_models import ARCHITECTURES, WINDOW, make_fallback_model
from tests.e2e.prompts import varied_prompts
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server

MAX_NEW_TOKENS = 10
SERVER_ARGS = (
    "--dtype",
    "float32",
    "--max-input-tokens",
    "400",
    "--max-total-tokens",
    "512",
    "--max-batch-total-tokens",
    "4096",
    "--block-size",
    "16",
    "--prometheus-port",
    "0",
    # The fallback's layers do not use genserve's CPU kernels; not waiting for their build
    # keeps these tests quick (the kernel's decode path is covered by the native tests).
    "--disable-cpu-kernels",
)
SEQUENTIAL = {"falcon", "qwen3_5_text"}
# Served by genserve's own model (model/families); every other entry by the fallback.
NATIVE = {
    "cohere",
    "deepseek_v3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "glm4_moe",
    "gpt_neox",
    "gpt_oss",
    "granite",
    "minimax_m2",
    "mixtral",
    "olmo2",
    "phi",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "smollm3",
    "stablelm",
    "starcoder2",
}


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return default_tokenizer_dir()


def _prompts() -> list[str]:
    # 4 prompts: a few tokens up to ~100, past the sliding window, sent together.
    return varied_prompts(10, seed=11, max_words=60)[3:10:2]


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_fallback_matches_transformers(
    model_type: str, tokenizer_dir: Path, tmp_path: Path
) -> None:
    model_dir = make_fallback_model(tmp_path / model_type, model_type, tokenizer_dir, seed=3)
    prompts = _prompts()
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS, ignore_eos=True)
    params = pb.GenerateParameters(
        max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, details=True
    )
    with inproc_server(model_dir, *SERVER_ARGS) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            info = stub.Info(pb.InfoRequest())

            def call(prompt: str) -> pb.GenerateResult:
                request = pb.GenerateRequest(inputs=[prompt], parameters=params)
                return stub.Generate(request).results[0]

            with ThreadPoolExecutor(len(prompts)) as pool:
                served = list(pool.map(call, prompts))
            # Again, alone: on the paged path its prompt's blocks now come from the prefix
            # cache, and only the rest is computed.
            served[-1] = call(prompts[-1])
            if model_type not in NATIVE:
                # LoRA is off on the fallback: an adapter is refused, not ignored.
                lora = pb.GenerateParameters(max_new_tokens=2, adapter_id=str(tmp_path / "adapter"))
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Generate(pb.GenerateRequest(inputs=["hello"], parameters=lora))
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "transformers fallback" in str(refused.value.details())
        server.wait_all_blocks_free()
    assert info.architecture.endswith("ForCausalLM")
    if model_type in NATIVE:
        assert info.implementation == "native"
        assert not info.disabled_features
    else:
        path = "transformers-sequential" if model_type in SEQUENTIAL else "transformers"
        assert info.implementation == path
        assert any(f.startswith("lora:") for f in info.disabled_features)
    lengths = [r.details.input_length for r in served]
    assert max(lengths) > 3 * WINDOW, lengths
    for prompt, result, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        got_ids = [t.id for t in result.details.tokens]
        assert got_ids == ids, f"{model_type}: prompt {prompt[:40]!r}..."
        got_lp = [t.logprob for t in result.details.tokens]
        assert got_lp == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "gpt_oss", "starcoder2"])
def test_randomized_vectors_matter(model_type: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    """The checkpoints' biases, norm weights and sinks change the output: a server that
    skipped them (or the soft-cap) would fail the parity test above."""
    model_dir = make_fallback_model(tmp_path / model_type, model_type, tokenizer_dir, seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 200, 3000, 45, 678, 9, 10, 11]])
    with torch.inference_mode():
        reference = model(ids).logits
        for param in model.parameters():
            if param.ndim == 1:  # back to transformers' initialisation
                init = 1.0 if param.mean().item() > 0.5 else 0.0
                param.fill_(init)
        skipped = model(ids).logits
    assert not torch.allclose(reference, skipped, atol=1e-3)


def test_unservable_config_exits_with_message(tmp_path: Path) -> None:
    """A checkpoint neither path can serve (no causal-LM class: a T5 encoder-decoder) stops
    the server at start-up with exit 2 and a message naming the architecture."""
    from transformers import T5Config, T5Model

    model_dir = tmp_path / "t5"
    config = T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
    T5Model(config).save_pretrained(str(model_dir))
    proc = subprocess.run(
        [sys.executable, "-m", "genserve.cli", "--model-id", str(model_dir), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "T5Model" in proc.stdout + proc.stderr
    assert "transformers fallback cannot serve" in proc.stdout + proc.stderr


def test_fallback_with_speculation(tokenizer_dir: Path, tmp_path: Path) -> None:
    """n-gram speculation on the paged fallback (Gemma 2, native by default, forced onto the
    fallback: soft-cap and sliding window): the draft tokens are verified as decode rows,
    and the output is still generate()'s."""
    model_dir = make_fallback_model(tmp_path / "gemma2", "gemma2", tokenizer_dir, seed=5)
    # Repetitive prompts, so the n-gram proposer finds drafts.
    prompts = [" ".join(["the quick brown fox jumps"] * n) for n in (4, 9, 15)]
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS, ignore_eos=True)
    params = pb.GenerateParameters(
        max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, details=True
    )
    with (
        inproc_server(
            model_dir, *SERVER_ARGS, "--speculate", "2", "--model-impl", "transformers"
        ) as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        assert (info.speculate, info.implementation) == (2, "transformers")

        def call(prompt: str) -> pb.GenerateResult:
            request = pb.GenerateRequest(inputs=[prompt], parameters=params)
            return stub.Generate(request).results[0]

        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(call, prompts))
    for result, (ids, logprobs) in zip(served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids
        assert [t.logprob for t in result.details.tokens] == pytest.approx(logprobs, abs=1e-3)


def test_remote_code_checkpoint_with_trust_remote_code(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose classes are its own code (``auto_map`` → modeling files in the
    directory) is served by the fallback under ``--trust-remote-code`` with generate()'s
    tokens.  The model runner once derived its serving path without the flag, so such a
    checkpoint stopped the start with transformers' "contains custom code" error."""
    import json

    model_dir = make_fallback_model(tmp_path / "custom", "qwen2", tokenizer_dir, seed=7)
    prompts = _prompts()[:2]
    # The remote class subclasses Qwen2ForCausalLM unchanged: the same weights give the same
    # tokens, so the reference is generate() on the checkpoint before it became remote code.
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS, ignore_eos=True)
    (model_dir / "configuration_custom.py").write_text(
        "from transformers import Qwen2Config\n\n\n"
        "class CustomQwen2Config(Qwen2Config):\n    model_type = 'custom_qwen2'\n"
    )
    (model_dir / "modeling_custom.py").write_text(
        "from transformers import Qwen2ForCausalLM\n\n"
        "from .configuration_custom import CustomQwen2Config\n\n\n"
        "class CustomQwen2ForCausalLM(Qwen2ForCausalLM):\n    config_class = CustomQwen2Config\n"
    )
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        model_type="custom_qwen2",
        architectures=["CustomQwen2ForCausalLM"],
        auto_map={
            "AutoConfig": "configuration_custom.CustomQwen2Config",
            "AutoModelForCausalLM": "modeling_custom.CustomQwen2ForCausalLM",
        },
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    params = pb.GenerateParameters(
        max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, details=True
    )
    with (
        inproc_server(model_dir, *SERVER_ARGS, "--trust-remote-code") as server,
        grpc.insecure_channel(server.address) as channel,
    ):
        stub = pb_grpc.TextGenerationServiceStub(channel)
        info = stub.Info(pb.InfoRequest())
        served = [
            stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params)).results[0]
            for prompt in prompts
        ]
    assert (info.architecture, info.implementation) == ("CustomQwen2ForCausalLM", "transformers")
    for result, (ids, logprobs) in zip(served, expected, strict=True):
        assert [t.id for t in result.details.tokens] == ids
        assert [t.logprob for t in result.details.tokens] == pytest.approx(logprobs, abs=1e-3)
