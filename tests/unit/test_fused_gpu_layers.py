"""The model's fused GPU path (``DecoderForCausalLM.use_fused_gpu_ops``) without Triton: the
``genserve_gpu::*`` ops run their torch references on the CPU, so this checks the path's
structure — the residual stream carried into the next add + norm, the rotary tables read by
position, the no-rope and per-step-angle layers — against the eager layers, bit for bit, for
families whose blocks differ (the kernels themselves: tests/unit/test_triton_fused.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.config import load_model_config
from genserve.model.registry import build_model
from genserve.model.rotary import RotaryEmbedding
from genserve.model.spec import RopeConfig
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from tests.conftest import TinyModelFactory

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("rope_type", "params", "rotary_dim"),
    [
        ("default", {}, 16),
        ("linear", {"factor": 4.0}, 8),
        ("yarn", {"factor": 4.0, "original_max_position_embeddings": 64}, 8),  # scaled, partial
        (
            "llama3",
            {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            16,
        ),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_is_the_per_step_angles(
    rope_type: str, params: dict[str, float], rotary_dim: int, dtype: torch.dtype
) -> None:
    """The load-time table, indexed by position, holds exactly the halves of the angles the
    eager path computes per step (cos repeated, sin negated on the first half)."""
    rope = RopeConfig(rope_type=rope_type, theta=10000.0, params=params)
    rotary = RotaryEmbedding(rope, 16, CPU, rotary_dim)
    table = rotary.half_table(300, dtype)
    assert table is not None
    positions = torch.tensor([0, 5, 63, 64, 299, 17])
    cos, sin = rotary.cos_sin(positions, dtype)  # [tokens, 1, 16]
    half_cos, half_sin = table[0][positions], table[1][positions]
    assert torch.equal(cos[:, 0], torch.cat((half_cos, half_cos), dim=-1))
    assert torch.equal(sin[:, 0], torch.cat((-half_sin, half_sin), dim=-1))


def test_length_dependent_angles_have_no_table() -> None:
    rope = RopeConfig(rope_type="dynamic", theta=10000.0,
                      params={"factor": 2.0, "original_max_position_embeddings": 64})  # fmt: skip
    assert RotaryEmbedding(rope, 16, CPU).half_table(300, torch.float32) is None


def _logits(model_dir: Path, fused: bool, dtype: torch.dtype) -> list[torch.Tensor]:
    """Two prompts prefilled, then three greedy decode steps: every step's logits."""
    config = load_model_config(model_dir)
    backend = TorchPagedAttention(CPU)
    block_size = 16
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), dtype, CPU)
        with SafetensorsWeights(model_dir) as weights:
            model.load_weights(weights)
        if fused:
            model.use_fused_gpu_ops(config.max_position_embeddings)
        shape = backend.kv_cache_shape(8, block_size, model.num_local_kv_heads, config.head_dim)
        caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_layers)]
        lengths, blocks = [5, 19], [(3, 5), (7, 1)]
        tokens = torch.randint(3, 1000, (sum(lengths),), generator=torch.Generator().manual_seed(1))
        positions = torch.cat([torch.arange(n) for n in lengths])
        seqs = [SeqSpec(n, 0, b) for n, b in zip(lengths, blocks, strict=True)]
        hidden = model(tokens, positions, caches, backend.build(seqs, 0, block_size))
        logits = [model.compute_logits(hidden[torch.tensor(lengths).cumsum(0) - 1])]
        for step in range(3):
            decode = [SeqSpec(1, n + step, b) for n, b in zip(lengths, blocks, strict=True)]
            meta = backend.build(decode, 2, block_size)
            hidden = model(logits[-1].argmax(-1), torch.tensor(lengths) + step, caches, meta)
            logits.append(model.compute_logits(hidden))
    return logits


@pytest.mark.parametrize(
    "arch",
    [
        "llama",  # pre-norm blocks: the residual carried through every layer
        "gemma2",  # sandwich norms, soft-capping, GELU-tanh, local and global rotary
        "phi",  # parallel attention + MLP, LayerNorm, partial rotary
        "smollm3",  # layers without rotary
        "olmo2",  # post-norms only, full-width q/k RMSNorm
        "qwen3",  # per-head q/k RMSNorm
        "phi3",  # longrope: angles computed per step
    ],
)
def test_fused_path_equals_the_eager_layers(
    tiny_model_factory: TinyModelFactory, arch: str
) -> None:
    """bfloat16, where a reordered sum would show: the same logits bit for bit."""
    model_dir = tiny_model_factory(arch, seed=3)
    want = _logits(model_dir, fused=False, dtype=torch.bfloat16)
    got = _logits(model_dir, fused=True, dtype=torch.bfloat16)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)
