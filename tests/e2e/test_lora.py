"""Multi-LoRA over real gRPC: a tiny float32 model, four PEFT-made adapters (different ranks
and target modules, one rsLoRA) preloaded under --max-active-adapters 2, so requests for
all of them (and the base model) in flight at once force evictions and slot reuse.
Every output must equal PEFT + transformers generate() with that adapter."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from genserve.testing.tiny_lora import make_lora_adapter
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.utils.inproc_server import InProcessServer, inproc_server

pytest.importorskip("peft")

MAX_NEW = 12
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS: dict[str, dict[str, Any]] = {
    "qv8": {"rank": 8, "targets": ("q_proj", "v_proj"), "seed": 1},
    "all4rs": {"rank": 4, "targets": ALL, "use_rslora": True, "seed": 2},
    "mlp16": {"rank": 16, "targets": ("gate_proj", "up_proj", "down_proj"), "seed": 3},
    "ko2": {"rank": 2, "alpha": 4, "targets": ("k_proj", "o_proj"), "seed": 4},
}


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: make_lora_adapter(tiny_llama, tmp_path_factory.mktemp(name), **kwargs)
        for name, kwargs in ADAPTERS.items()
    }


@pytest.fixture(scope="module")
def lora_server(tiny_llama: Path, adapter_dirs: dict[str, Path]) -> Iterator[InProcessServer]:
    preload = ",".join(f"{name}={path}" for name, path in adapter_dirs.items())
    args = ("--lora-adapters", preload, "--max-active-adapters", "2")
    with inproc_server(tiny_llama, *PARITY_SERVER_ARGS, *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def lora_stub(lora_server: InProcessServer) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    with grpc.insecure_channel(lora_server.address) as channel:
        yield pb_grpc.TextGenerationServiceStub(channel)


def _generate(
    stub: pb_grpc.TextGenerationServiceStub, prompt: str, adapter: str | None
) -> pb.GenerateResult:
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW, details=True)
    if adapter is not None:
        params.adapter_id = adapter
    return stub.Generate(pb.GenerateRequest(inputs=[prompt], parameters=params)).results[0]


def test_mixed_adapters_match_peft_with_eviction(
    tiny_llama: Path,
    adapter_dirs: dict[str, Path],
    lora_server: InProcessServer,
    lora_stub: pb_grpc.TextGenerationServiceStub,
) -> None:
    from tests.unit.test_lora_runner import peft_greedy

    names: list[str | None] = [*ADAPTERS, None]
    prompts = varied_prompts(15, seed=11, max_words=60)
    jobs = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    free_before = lora_server.num_free_blocks()
    with ThreadPoolExecutor(len(jobs)) as pool:
        served = list(pool.map(lambda job: _generate(lora_stub, *job), jobs))
    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    for (prompt, adapter), result in zip(jobs, served, strict=True):
        ids = tok(prompt).input_ids
        want_ids, want_lps = peft_greedy(
            tiny_llama, adapter_dirs[adapter] if adapter else None, ids, MAX_NEW
        )
        got = [t.id for t in result.details.tokens]
        assert got == want_ids[: len(got)], (adapter, prompt)
        if result.details.finish_reason != pb.FINISH_REASON_EOS_TOKEN:
            assert len(got) == MAX_NEW
        lps = [t.logprob for t in result.details.tokens]
        assert lps == pytest.approx(want_lps[: len(got)], abs=1e-3)
    manager = lora_server.engine.adapters
    assert manager is not None
    assert sum(s.evictions for s in manager.stats.values()) > 0  # 4 adapters in 2 slots
    info = lora_stub.Info(pb.InfoRequest())
    assert info.max_active_adapters == 2 and len(info.loaded_adapters) <= 2
    assert lora_server.num_free_blocks() >= free_before  # nothing leaked (cache may free more)


def test_prefix_cache_is_keyed_by_adapter(lora_stub: pb_grpc.TextGenerationServiceStub) -> None:
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    first = _generate(lora_stub, prompt, "qv8")
    again = _generate(lora_stub, prompt, "qv8")
    other = _generate(lora_stub, prompt, "mlp16")
    assert again.details.cached_tokens > 0  # same adapter: shared
    assert other.details.cached_tokens == 0  # another adapter: never shared
    assert first.generated_text == again.generated_text


def test_bad_adapters_get_their_status_and_the_server_keeps_serving(
    tiny_model_factory: Any,
    adapter_dirs: dict[str, Path],
    lora_stub: pb_grpc.TextGenerationServiceStub,
    tmp_path: Path,
) -> None:
    with pytest.raises(grpc.RpcError) as missing:
        _generate(lora_stub, "hello", str(tmp_path / "no-such-adapter"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in str(missing.value.details())
    with pytest.raises(grpc.RpcError) as missing_stream:  # GenerateStream maps it the same
        _stream(lora_stub, "hello", str(tmp_path / "no-such-adapter"))
    assert missing_stream.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-adapter" in str(missing_stream.value.details())

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (adapter_dirs["qv8"] / "adapter_config.json").read_text()
    )
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(grpc.RpcError) as bad:
        _generate(lora_stub, "hello", str(corrupt))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot read it" in str(bad.value.details())
    with pytest.raises(grpc.RpcError) as bad_stream:
        _stream(lora_stub, "hello", str(corrupt))
    assert bad_stream.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot read it" in str(bad_stream.value.details())

    other_base = tiny_model_factory("llama", hidden_size=96, num_attention_heads=6,
                                    num_key_value_heads=3)  # fmt: skip
    wrong = make_lora_adapter(other_base, tmp_path / "wrong", rank=4)
    with pytest.raises(grpc.RpcError) as shape:
        _generate(lora_stub, "hello", str(wrong))
    assert shape.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "q_proj" in str(shape.value.details())

    assert _generate(lora_stub, "still serving", "ko2").details.generated_tokens > 0
    assert len(_stream(lora_stub, "still streaming", "ko2")) == MAX_NEW


def _stream(
    stub: pb_grpc.TextGenerationServiceStub, prompt: str, adapter: str
) -> list[pb.GenerateStreamResponse]:
    params = pb.GenerateParameters(
        max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, ignore_eos=True, adapter_id=adapter
    )
    return list(stub.GenerateStream(pb.GenerateStreamRequest(inputs=prompt, parameters=params)))


def test_python_client_passes_adapter_id(
    lora_server: InProcessServer, lora_stub: pb_grpc.TextGenerationServiceStub
) -> None:
    from genserve.client import Client, GenserveError, InvalidArgumentError

    prompt = "the quick brown fox"
    with Client(lora_server.address, timeout=60) as client:
        tuned = client.generate(prompt, max_new_tokens=MAX_NEW, adapter_id="all4rs")
        base = client.generate(prompt, max_new_tokens=MAX_NEW)
        with pytest.raises(GenserveError) as missing:
            client.generate(prompt, max_new_tokens=2, adapter_id="/no/such/adapter")
    assert not isinstance(missing.value, InvalidArgumentError)
    assert tuned.generated_text == _generate(lora_stub, prompt, "all4rs").generated_text
    assert base.generated_text == _generate(lora_stub, prompt, None).generated_text
    assert tuned.generated_text != base.generated_text
