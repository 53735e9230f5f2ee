"""genserve's fused Triton layer kernels (the CUDA path's residual add + RMSNorm, rotary + paged
K/V store, gated activation; ``kernels/fused_gpu_ops.py``), run on CPU through Triton's
interpreter (``TRITON_INTERPRET=1``) against their torch references, and inside the model
against the eager layers.

The interpreter must be switched on before the kernels are defined, so each check runs in
another process: the session's ``triton_interpreter`` (tests/utils/triton_interpreter.py).
The interpreter rounds float32 → bfloat16 by truncation, not to nearest as a GPU does
(checked: its sums equal torch's truncated, not torch's rounded), so bfloat16 results are
compared within a few bfloat16 steps; float32 results within float32 rounding.  The
references themselves equal the eager model op for op (the last tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import TinyModelFactory
from tests.utils.triton_interpreter import TritonInterpreter, needs_triton

# float32: rounding of differently ordered sums; bfloat16: the interpreter's truncation
# compounds over two or three roundings (each at most one step, 2**-7 relative).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    atol, rtol = TOLERANCE[want.dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_norms(device: str = "cpu") -> None:
    from genserve.kernels import fused_gpu_ops as ops

    assert ops.triton_runs(torch.device(device))  # kernels, not references (CPU: interpreted)
    gen = torch.Generator().manual_seed(0)
    # (rows, hidden, row stride): one row, an odd width, a wide row, rows inside a wider
    # tensor (the [q | k | v] projection's q part, a full-width q norm's input); then heads.
    for dtype in (torch.float32, torch.bfloat16):
        for rows, hidden, stride in ((1, 64, 64), (7, 333, 333), (3, 1000, 1000), (5, 96, 160)):
            wide = torch.randn(rows, stride, generator=gen).to(device, dtype)
            x = wide[:, :hidden]
            residual = torch.randn(rows, hidden, generator=gen).to(device, dtype)
            weight = (torch.rand(hidden, generator=gen) + 0.5).to(device, dtype)
            what = f"{dtype} {rows}x{hidden}"
            want, _ = ops.rms_norm_reference(x, weight, 1e-6)
            _close(ops.rms_norm(x, weight, 1e-6), want, f"rms_norm {what}")
            want_normed, want_summed = ops.rms_norm_reference(x, weight, 1e-5, residual)
            summed, normed = ops.add_rms_norm(x, residual, weight, 1e-5)
            assert want_summed is not None
            _close(summed, want_summed, f"add {what}")
            _close(normed, want_normed, f"add_rms_norm {what}")
            if dtype == torch.float32:  # one float32 rounding of one add: exact
                assert torch.equal(summed, want_summed)
        # A per-head q/k norm's input: [tokens, heads, head_dim] heads of a wider projection.
        qkv = torch.randn(3, 7 * 24, generator=gen).to(device, dtype)
        heads = qkv[:, : 5 * 24].view(3, 5, 24)
        weight = (torch.rand(24, generator=gen) + 0.5).to(device, dtype)
        want, _ = ops.rms_norm_reference(heads, weight, 1e-6)
        _close(ops.rms_norm(heads, weight, 1e-6), want, f"per-head rms_norm {dtype}")


def check_gated_act(device: str = "cpu") -> None:
    from genserve.kernels import fused_gpu_ops as ops

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        # Widths: odd, exactly one 1,024-wide program, several programs with a ragged end.
        for rows, n in ((1, 77), (5, 1024), (3, 2500)):
            gate_up = (torch.randn(rows, 2 * n, generator=gen) * 3).to(device, dtype)
            for activation in ops.ACTIVATIONS:
                want = ops.gated_act_reference(gate_up, activation)
                got = ops.gated_act(gate_up, activation)
                _close(got, want, f"{activation} {dtype} {rows}x{n}")


def check_rotary_store_kv(device: str = "cpu") -> None:
    from genserve.kernels import fused_gpu_ops as ops

    gen = torch.Generator().manual_seed(2)
    num_tokens, block_size, num_blocks, max_positions = 5, 4, 6, 40
    slots = torch.tensor(
        [0, 9, 23, 4, 17], device=device
    )  # scattered over blocks, one reused block offset
    positions = torch.tensor([3, 39, 0, 17, 8], device=device)
    # (heads, kv_heads, head_dim): MHA, GQA, MQA, a half width (40) that is no power of two.
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, head_dim in ((4, 4, 16), (6, 2, 16), (8, 1, 32), (3, 1, 80)):
            half = head_dim // 2
            width = (heads + 2 * kv_heads) * head_dim
            for layout in (ops.HEADS_FIRST, ops.BLOCKS_FIRST):
                for mode in ("table", "per-token", "none"):
                    qkv = torch.randn(num_tokens, width, generator=gen).to(device, dtype)
                    rows = max_positions if mode == "table" else num_tokens
                    cos = torch.rand(rows, half, generator=gen).to(device, dtype)
                    sin = torch.rand(rows, half, generator=gen).to(device, dtype)
                    if layout == ops.HEADS_FIRST:
                        shape = (2, kv_heads, num_blocks, block_size, head_dim)
                    else:
                        shape = (2, num_blocks, block_size, kv_heads, head_dim)
                    cache = torch.randn(shape, generator=gen).to(device, dtype)
                    want_qkv, want_cache = qkv.clone(), cache.clone()
                    args = (
                        (cos, sin, positions)
                        if mode == "table"
                        else (cos, sin, None)
                        if mode == "per-token"
                        else (None, None, None)
                    )
                    for buf, kv in ((qkv, cache), (want_qkv, want_cache)):
                        qk = buf[:, : (heads + kv_heads) * head_dim]
                        qk = qk.view(num_tokens, heads + kv_heads, head_dim)
                        v = buf[:, (heads + kv_heads) * head_dim :]
                        v = v.view(num_tokens, kv_heads, head_dim)
                        if kv is cache:
                            ops.rotary_store_kv(qk, v, *args, slots, kv, layout)
                        else:
                            ops.rotary_store_kv_reference(qk, v, *args, slots, kv, layout)
                    what = f"{dtype} {heads}/{kv_heads}x{head_dim} layout {layout} {mode}"
                    _close(qkv, want_qkv, f"rotated q/k {what}")
                    _close(cache, want_cache, f"cache {what}")
                    if mode == "none":  # a copy: exact
                        assert torch.equal(cache, want_cache), what


def check_model(model_dir: str, device: str = "cpu") -> None:
    """Prefill, then decode steps: the fused layers (Triton; interpreted on CPU) against the eager
    layers, float32: the same greedy tokens, logits within float32 rounding."""
    from genserve.model.attention import SeqSpec, TorchPagedAttention
    from genserve.model.config import load_model_config
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    config = load_model_config(Path(model_dir))
    dev = torch.device(device)
    block_size = 16
    backend = TorchPagedAttention(dev)

    def run(fused: bool) -> list[torch.Tensor]:
        with torch.inference_mode():
            model = build_model(config, ParallelContext.single(), torch.float32, dev)
            with SafetensorsWeights(Path(model_dir)) as weights:
                model.load_weights(weights)
            if fused:
                model.use_fused_gpu_ops(config.max_position_embeddings)
            shape = backend.kv_cache_shape(8, block_size, model.num_local_kv_heads, config.head_dim)
            caches = [torch.zeros(shape, device=dev) for _ in range(config.num_layers)]
            lengths = [5, 19]
            blocks = [(3, 5), (7, 1)]
            gen = torch.Generator().manual_seed(1)
            tokens = torch.randint(3, 1000, (sum(lengths),), generator=gen).to(dev)
            positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
            seqs = [SeqSpec(n, 0, b) for n, b in zip(lengths, blocks, strict=True)]
            hidden = model(tokens, positions, caches, backend.build(seqs, 0, block_size))
            ends = torch.tensor(lengths, device=dev).cumsum(0) - 1
            logits = [model.compute_logits(hidden[ends])]
            for step in range(3):
                next_tokens = logits[-1].argmax(-1)
                decode = [SeqSpec(1, n + step, b) for n, b in zip(lengths, blocks, strict=True)]
                next_positions = torch.tensor(lengths, device=dev) + step
                meta = backend.build(decode, 2, block_size)
                logits.append(
                    model.compute_logits(model(next_tokens, next_positions, caches, meta))
                )
            return logits

    for want, got in zip(run(False), run(True), strict=True):
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_triton
def test_each_kernel_matches_its_reference(triton_interpreter: TritonInterpreter) -> None:
    """One interpreter process for the three kernels (starting one costs seconds)."""
    triton_interpreter.run(
        "from tests.unit.test_triton_fused import check_norms, check_gated_act, "
        "check_rotary_store_kv; check_norms(); check_gated_act(); check_rotary_store_kv()"
    )


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_fused_layers_match_the_eager_model(
    tiny_model_factory: TinyModelFactory, triton_interpreter: TritonInterpreter, arch: str
) -> None:
    """Llama (the nine-launch layer), Phi-3 (partial rotary, longrope angles per step)."""
    model_dir = tiny_model_factory(arch)
    triton_interpreter.run(
        "import sys; from tests.unit.test_triton_fused import check_model; "
        "check_model(sys.argv[1])",
        str(model_dir),
    )


def check_direct_launch() -> None:
    """Where Triton runs (here: interpreted), the public functions launch their kernels
    directly, never through the custom ops (whose dispatch costs the host of an eager step
    15-20 µs a call): with the ops made to fail, every function still answers."""
    from genserve.kernels import fused_gpu_ops as ops

    def refuse(*args: object) -> None:
        raise AssertionError("went through the custom op")

    for name in ("rms_norm_op", "add_rms_norm_op", "gated_act_op", "rotary_store_kv_op"):
        setattr(ops, name, refuse)
    x, w = torch.randn(2, 32), torch.rand(32) + 0.5
    ops.rms_norm(x, w, 1e-6)
    ops.add_rms_norm(x, x.clone(), w, 1e-6)
    ops.gated_act(torch.randn(2, 64), "silu")
    kv_cache = torch.zeros(2, 2, 4, 16, 8)  # [K|V, KV heads, blocks, block size, head dim]
    qk = torch.randn(3, 4, 8)  # two Q heads, two K heads
    slots = torch.tensor([0, 5, 17])
    v = torch.randn(3, 2, 8)
    ops.rotary_store_kv(qk, v, None, None, None, slots, kv_cache, ops.HEADS_FIRST)
    assert torch.equal(kv_cache[1, :, 0, 5], v[1])


@needs_triton
def test_kernels_launch_without_the_custom_ops(triton_interpreter: TritonInterpreter) -> None:
    triton_interpreter.run(
        "from tests.unit.test_triton_fused import check_direct_launch; check_direct_launch()"
    )


def test_without_triton_each_call_is_one_custom_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without Triton's interpreter (the proof test's setting) the calls go through
    the custom ops, one op each to the dispatcher, running the torch references."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from genserve.kernels import fused_gpu_ops as ops

    assert not ops.triton_runs(torch.device("cpu"))
    calls: list[str] = []

    class Count(TorchDispatchMode):  # type: ignore[misc,no-untyped-call]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            calls.append(str(func))
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(2, 32), torch.rand(32) + 0.5
    with Count():  # type: ignore[no-untyped-call]
        ops.rms_norm(x, w, 1e-6)
        ops.gated_act(torch.randn(2, 64), "silu")
    assert [c for c in calls if "genserve_gpu" in c] == [
        "genserve_gpu.rms_norm.default",
        "genserve_gpu.gated_act.default",
    ], calls
