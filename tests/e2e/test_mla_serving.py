"""DeepSeek-V3's multi-head latent attention served natively over real gRPC (issue #26):
tiny random-weight float32 checkpoints (tests/utils/mla_models.py: with and without query
compression, YaRN-scaled rope, 3 layers of which the first dense, 8 experts in 2 groups),
four concurrent prompts of a few to ~300 words: greedy tokens equal transformers
``generate()``, logprobs within 1e-3, ``Info`` says native and sizes the KV cache by the
latent rows (``kv_lora_rank + qk_rope_head_dim`` values per token and layer).  Prompts that
share a long prefix give the same output with prefix caching on (their latent blocks
reused) and off; and the model serves on two shards (heads split, latent replicated).

tests/unit/test_mla.py checks the logits, the cache contents and that the mscale, the rope
layout and the latent norms each change the reference."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.v1 import generate_pb2 as pb
from genserve.v1 import generate_pb2_grpc as pb_grpc
from tests.e2e.prompts import PARITY_SERVER_ARGS, varied_prompts
from tests.utils.hf_reference import hf_greedy
from tests.utils.inproc_server import inproc_server
from tests.utils.mla_models import MLA_VARIANTS, make_mla_model

MAX_NEW_TOKENS = 16
PROMPTS = [varied_prompts(12, seed=7)[i] for i in (0, 4, 6, 9)]
# Latent 32 + rope 16 values, float32, 3 layers.
BYTES_PER_TOKEN = (32 + 16) * 4 * 3


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla-serving")
    tok = default_tokenizer_dir()
    return {v: make_mla_model(root / v, v, tok, seed=4) for v in MLA_VARIANTS}


def _generate(
    stub: pb_grpc.TextGenerationServiceStub, prompts: list[str], concurrent: bool = True
) -> list[pb.Details]:
    params = pb.GenerateParameters(max_new_tokens=MAX_NEW_TOKENS, details=True)

    def call(prompt: str) -> pb.Details:
        request = pb.GenerateRequest(inputs=[prompt], parameters=params)
        details: pb.Details = stub.Generate(request, timeout=300).results[0].details
        return details

    if not concurrent:
        return [call(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(call, prompts))


def _check(model_dir: Path, prompts: list[str], served: list[pb.Details]) -> None:
    expected = hf_greedy(model_dir, prompts, MAX_NEW_TOKENS)
    for prompt, got, (ids, logprobs) in zip(prompts, served, expected, strict=True):
        assert [t.id for t in got.tokens] == ids, prompt[:40]
        assert [t.logprob for t in got.tokens] == pytest.approx(logprobs, abs=1e-3)


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
def test_mla_matches_transformers(variant: str, mla_dirs: dict[str, Path]) -> None:
    model_dir = mla_dirs[variant]
    with inproc_server(model_dir, *PARITY_SERVER_ARGS) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            info = stub.Info(pb.InfoRequest())
            served = _generate(stub, PROMPTS)
        server.wait_all_blocks_free()
    assert info.implementation == "native"
    assert info.architecture == "DeepseekV3ForCausalLM"
    assert info.kv_cache_bytes == info.num_kv_blocks * info.block_size * BYTES_PER_TOKEN
    assert max(d.input_length for d in served) > 200
    _check(model_dir, PROMPTS, served)


def test_prefix_caching_on_and_off_equal(mla_dirs: dict[str, Path]) -> None:
    """Three prompts sharing a ~300-word prefix, one after the other: with prefix caching
    the later ones read the prefix's latent blocks from the cache; without, they compute
    them.  The same tokens either way, and transformers' tokens."""
    model_dir = mla_dirs["deepseek_v3"]
    shared = PROMPTS[3]
    prompts = [shared + ending for ending in (" One.", " And then two", " Three, four, five")]
    outputs: dict[bool, list[pb.Details]] = {}
    for caching in (True, False):
        args = PARITY_SERVER_ARGS + (() if caching else ("--disable-prefix-caching",))
        with inproc_server(model_dir, *args) as server:
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.TextGenerationServiceStub(channel)
                outputs[caching] = _generate(stub, prompts, concurrent=False)
            server.wait_all_blocks_free()
    cached = [d.cached_tokens for d in outputs[True]]
    assert cached[0] == 0 and min(cached[1:]) >= 200, cached
    assert [d.cached_tokens for d in outputs[False]] == [0, 0, 0]
    for on, off in zip(outputs[True], outputs[False], strict=True):
        assert [t.id for t in on.tokens] == [t.id for t in off.tokens]
        assert [t.logprob for t in on.tokens] == pytest.approx(
            [t.logprob for t in off.tokens], abs=1e-4
        )
    _check(model_dir, prompts, outputs[True])


def test_two_shards_match_transformers(mla_dirs: dict[str, Path]) -> None:
    from tests.e2e.test_tensor_parallel import generate_all, info
    from tests.e2e.tp_utils import SERVER_ARGS, shard_args, start_servers

    model_dir = mla_dirs["deepseek_v3"]
    with start_servers([(model_dir, SERVER_ARGS + shard_args(2))]) as (server,):
        served = generate_all(server, PROMPTS, MAX_NEW_TOKENS)
        reply = info(server)
    # Each shard holds the whole latent (replicated): the same bytes per token as one shard.
    assert reply.kv_cache_bytes == reply.num_kv_blocks * reply.block_size * BYTES_PER_TOKEN
    _check(model_dir, PROMPTS, served)
