"""genserve's Triton paged decode-attention kernel (the CUDA decode path), run on CPU through
Triton's interpreter (``TRITON_INTERPRET=1``): against a float64 reference over the block
table, and inside the model against the SDPA path on the same cache.

The interpreter must be switched on before Triton is imported, so the checks run in another
process: the session's ``triton_interpreter`` (tests/utils/triton_interpreter.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.conftest import TinyModelFactory
from tests.utils.triton_interpreter import TritonInterpreter, needs_triton

pytestmark = needs_triton


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Decode attention in float64, one sequence at a time, gathering the blocks."""
    _, num_kv_heads, _, block_size, head_dim = cache.shape
    group = q.shape[1] // num_kv_heads
    outs = []
    for i in range(q.shape[0]):
        n = int(lens[i])
        blocks = table[i, : -(-n // block_size)]
        ctx = cache[:, :, blocks].reshape(2, num_kv_heads, -1, head_dim)[:, :, :n].double()
        k = ctx[0].repeat_interleave(group, 0)
        v = ctx[1].repeat_interleave(group, 0)
        scores = torch.einsum("hd,hld->hl", q[i].double(), k) * scale
        if window is not None:
            scores[:, torch.arange(n) <= n - 1 - window] = float("-inf")
        outs.append(torch.einsum("hl,hld->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def check_kernel() -> None:
    from genserve.kernels import triton_attention

    gen = torch.Generator().manual_seed(0)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    # (heads, kv_heads, head_dim, block_size, window): MHA, GQA 9/3 (the default model),
    # MQA, a head size that is no power of two, 32-token blocks, sliding windows.
    shapes = [
        (4, 2, 16, 16, None),
        (9, 3, 64, 16, None),
        (8, 8, 80, 32, 5),
        (6, 1, 128, 16, 20),
    ]
    for dtype, tol in tolerance.items():
        for heads, kv_heads, head_dim, block_size, window in shapes:
            num_blocks = 40
            cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen)
            cache = cache.to(dtype)
            lens = torch.tensor([1, 17, 50, 33, block_size * 8])
            table = torch.stack([torch.randperm(num_blocks, generator=gen)[:8] for _ in lens])
            q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
            scale = head_dim**-0.5
            out = triton_attention.paged_decode_attention(q, cache, table, lens, scale, window)
            want = reference(q, cache, table, lens, scale, window)
            err = (out.double() - want).abs().max().item()
            assert out.dtype == dtype and out.shape == q.shape
            assert err < tol, (dtype, heads, kv_heads, head_dim, block_size, window, err)
    empty = torch.empty(0, 4, 16)
    cache = torch.zeros(2, 2, 4, 16, 16)
    assert triton_attention.paged_decode_attention(
        empty, cache, torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
        1.0, None,
    ).shape == (0, 4, 16)  # fmt: skip


def check_model(model_dir: str) -> None:
    """Prefill three prompts (SDPA), then one decode step through both decode paths: the
    logits of the Triton path equal the SDPA path's."""
    from genserve.model.attention import SeqSpec, TorchPagedAttention
    from genserve.model.config import load_model_config
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    config = load_model_config(Path(model_dir))
    cpu = torch.device("cpu")
    block_size = 16
    with torch.inference_mode():
        model = build_model(config, ParallelContext.single(), torch.float32, cpu)
        with SafetensorsWeights(Path(model_dir)) as weights:
            model.load_weights(weights)
        sdpa = TorchPagedAttention(cpu)
        triton_backend = TorchPagedAttention(cpu, use_triton_decode=True)
        assert triton_backend.name == "torch-sdpa+triton-decode"
        shape = sdpa.kv_cache_shape(16, block_size, model.num_local_kv_heads, config.head_dim)
        caches = [torch.zeros(shape) for _ in range(config.num_layers)]
        gen = torch.Generator().manual_seed(1)
        lengths = [5, 16, 37]
        blocks = [(3,), (7, 1), (9, 2, 12)]
        tokens = torch.randint(3, 1000, (sum(lengths),), generator=gen)
        positions = torch.cat([torch.arange(n) for n in lengths])
        seqs = [SeqSpec(n, 0, b) for n, b in zip(lengths, blocks, strict=True)]
        model(tokens, positions, caches, sdpa.build(seqs, 0, block_size))
        decode = [SeqSpec(1, n, b) for n, b in zip(lengths, blocks, strict=True)]
        next_tokens = torch.randint(3, 1000, (3,), generator=gen)
        next_positions = torch.tensor(lengths)

        def logits(backend: TorchPagedAttention) -> torch.Tensor:
            run = [c.clone() for c in caches]
            meta = backend.build(decode, 3, block_size)
            return model.compute_logits(model(next_tokens, next_positions, run, meta))

        want, got = logits(sdpa), logits(triton_backend)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_kernel_matches_reference_in_every_dtype(triton_interpreter: TritonInterpreter) -> None:
    triton_interpreter.run(
        "from tests.unit.test_triton_attention import check_kernel; check_kernel()"
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_step_matches_sdpa_inside_the_model(
    tiny_model_factory: TinyModelFactory, triton_interpreter: TritonInterpreter, arch: str
) -> None:
    model_dir = tiny_model_factory(arch)
    triton_interpreter.run(
        "import sys; from tests.unit.test_triton_attention import check_model; "
        "check_model(sys.argv[1])",
        str(model_dir),
    )


def test_only_cuda_selects_the_triton_decode_path() -> None:
    from genserve.kernels import triton_attention
    from genserve.model.attention_backend import select_backend

    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not triton_attention.available(torch.device("cpu"))
    assert "triton" not in select_backend(torch.device("cpu"), 16, torch.float32).name
    assert triton_attention.supports(16, 64) and triton_attention.supports(32, 256)
    assert not triton_attention.supports(8, 64)  # below one tl.dot tile
    assert not triton_attention.supports(24, 64)  # not a power of two


def test_triton_version_gate() -> None:
    """``input_precision=`` needs Triton 3.0: older versions are refused by available()."""
    from genserve.kernels import triton_attention

    assert triton_attention.triton_version_ok("3.0.0")
    assert triton_attention.triton_version_ok("3.9.0+git5a9b1c")
    assert not triton_attention.triton_version_ok("2.3.1")


def test_availability_is_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``available()`` is asked before every fused op of every layer: reading Triton's
    package metadata each time made most of an eager 8B step on the GPU machine."""
    import importlib.metadata

    from genserve.kernels import triton_attention

    triton_attention.available(torch.device("cpu"))  # decided here, or earlier
    calls: list[str] = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: calls.append(name) or "3.0")
    for _ in range(3):
        triton_attention.available(torch.device("cuda"))
    assert calls == []
