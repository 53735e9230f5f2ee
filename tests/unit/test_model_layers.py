"""Building blocks: rotary frequencies against transformers, KV-head assignment across
tensor-parallel ranks, the slot mapping of the paged cache."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from genserve.model.attention import SeqSpec, TorchPagedAttention, slot_mapping
from genserve.model.config import (
    RopeConfig,
    UnsupportedModelError,
    config_from_hf,
    load_model_config,
)
from genserve.model.layers import local_kv_heads
from genserve.model.rotary import attention_factor, rope_inv_freq
from genserve.parallel import ParallelContext
from tests.conftest import TinyModelFactory


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
         "original_max_position_embeddings": 1024},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "beta_fast": 16.0,
         "mscale": 0.7, "mscale_all_dim": 1.0, "original_max_position_embeddings": 512},
        {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0,
         "short_factor": [1.0 + i / 64 for i in range(64)],
         "long_factor": [2.0 + i / 16 for i in range(64)],
         "original_max_position_embeddings": 1024},
    ],
)  # fmt: skip
def test_rope_inv_freq_matches_transformers(rope: dict[str, Any]) -> None:
    hf = LlamaConfig(hidden_size=256, num_attention_heads=2, rope_parameters=dict(rope))
    expected, scaling = ROPE_INIT_FUNCTIONS[str(rope["rope_type"])](hf, None)
    ours = config_from_hf(hf).rope
    assert torch.equal(rope_inv_freq(ours, 128), expected)
    assert attention_factor(ours) == pytest.approx(scaling, rel=1e-12)
    if rope["rope_type"] == "longrope":  # past the original context: the long factors
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=2000)
        assert torch.equal(rope_inv_freq(ours, 128, long=True), long)


def test_unsupported_rope_type_is_reported() -> None:
    with pytest.raises(UnsupportedModelError, match="mrope"):
        rope_inv_freq(RopeConfig(rope_type="mrope"), 64)


def kv_heads(num_heads: int, num_kv: int, world: int) -> list[tuple[int, ...]]:
    return [local_kv_heads(num_heads, num_kv, ParallelContext(r, world)) for r in range(world)]


def test_kv_heads_split_evenly_when_divisible() -> None:
    assert kv_heads(8, 4, 2) == [(0, 1), (2, 3)]
    assert kv_heads(9, 3, 1) == [(0, 1, 2)]
    assert kv_heads(8, 8, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_kv_heads_replicated_when_fewer_than_ranks() -> None:
    assert kv_heads(8, 2, 4) == [(0,), (0,), (1,), (1,)]
    assert kv_heads(4, 1, 2) == [(0,), (0,)]


def test_kv_heads_not_divisible_by_ranks() -> None:
    # 6 query heads in groups of 2 over 2 ranks: rank 0 has q0..q2 -> kv 0, 0, 1.  Stored
    # once per query head so every local query head has its own KV head (uniform groups).
    assert kv_heads(6, 3, 2) == [(0, 0, 1), (1, 2, 2)]
    # Query heads that do not divide are spread 5/4 (ParallelContext.balanced_shard).
    assert kv_heads(9, 3, 2) == [(0, 0, 0, 1, 1), (1, 2, 2, 2)]


def test_slot_mapping_follows_block_tables() -> None:
    seqs = [SeqSpec(1, 17, (7, 3)), SeqSpec(3, 14, (9, 2))]
    # decode at pos 17 -> block 3 offset 1; prefill 14, 15 in block 9, 16 in block 2
    assert slot_mapping(seqs, 1, 16).tolist() == [3 * 16 + 1, 9 * 16 + 14, 9 * 16 + 15, 2 * 16]


def reference_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], positions: list[int]
) -> torch.Tensor:
    """Float32, one sequence at a time, straight from the definition."""
    _, kv_heads, _, _, head_dim = cache.shape
    group = q.shape[1] // kv_heads
    outs = []
    for i, (table, pos) in enumerate(zip(tables, positions, strict=True)):
        kv = cache[:, :, table].reshape(2, kv_heads, -1, head_dim)[:, :, : pos + 1].float()
        k = kv[0].repeat_interleave(group, 0)  # [heads, ctx, hd]
        v = kv[1].repeat_interleave(group, 0)
        weights = torch.softmax(
            (q[i].float()[:, None, :] @ k.transpose(1, 2))[:, 0] * head_dim**-0.5, -1
        )
        outs.append((weights[:, None, :] @ v)[:, 0].reshape(-1))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_decodes", [1, 9])
def test_batched_decode_attention(dtype: torch.dtype, num_decodes: int) -> None:
    """Both decode paths (SDPA; two matmuls for many half-precision decodes) read the right
    blocks and mask the padding of shorter sequences."""
    gen = torch.Generator().manual_seed(0)
    backend = TorchPagedAttention(torch.device("cpu"))
    cache = torch.randn(backend.kv_cache_shape(64, 16, 2, 32), generator=gen).to(dtype)
    positions = [int(p) for p in torch.randint(0, 80, (num_decodes,), generator=gen)]
    order = torch.randperm(64, generator=gen).tolist()
    tables = [order[i * 6 : (i + 1) * 6] for i in range(num_decodes)]
    seqs = [SeqSpec(1, p, tuple(t)) for p, t in zip(positions, tables, strict=True)]
    meta = backend.build(seqs, num_decodes, 16)
    q = torch.randn(num_decodes, 6, 32, generator=gen).to(dtype)
    out = meta.attend(q, q[:, :2], q[:, :2], cache, 32**-0.5, None)
    tables = [t[: p // 16 + 1] for t, p in zip(tables, positions, strict=True)]
    expected = reference_decode_attention(q, cache, tables, positions)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.shape == expected.shape
    assert torch.allclose(out.float(), expected, atol=tolerance)


def test_prepacked_bf16_weights_give_the_same_logits(tiny_model_factory: TinyModelFactory) -> None:
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights

    model_dir = tiny_model_factory("qwen2")  # untied head and biases: every packed path
    config = load_model_config(model_dir)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), torch.bfloat16, cpu)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        backend = TorchPagedAttention(cpu)
        tokens = torch.randint(3, 1000, (37,), generator=torch.Generator().manual_seed(0))

        def logits() -> torch.Tensor:
            shape = backend.kv_cache_shape(8, 16, model.num_local_kv_heads, config.head_dim)
            caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(config.num_layers)]
            meta = backend.build([SeqSpec(37, 0, (4, 2, 6))], 0, 16)
            return model.compute_logits(model(tokens, torch.arange(37), caches, meta))

        plain = logits()
        model.pack_weights()
        gate_up = model._layers[0].mlp.gate_up_proj
        if gate_up.packed is None:
            # torch builds for CPUs without AVX-512 (AVX2-only machines) refuse oneDNN's
            # blocked bf16 layout; the layers then keep F.linear, which the rest covers.
            pytest.skip("this torch/CPU does not prepack bf16 weights for oneDNN")
        assert gate_up.weight.numel() == 0  # the plain copy is released
        assert torch.allclose(logits(), plain, atol=1e-2)
