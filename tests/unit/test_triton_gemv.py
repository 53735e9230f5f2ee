"""The CUDA path's few-row matmul (``kernels/triton_gemv``) and the plan that gives it the
projections where it beats cuBLAS (``model/gpu_gemv_plan``).

The kernel runs on CPU under Triton's interpreter (another process: see
tests/utils/triton_interpreter.py) against its float32 reference, for every tile, 1-4 rows,
ragged ``K`` and ``N``, a bias, float32 and half-precision outputs and a strided ``x``; the
``cuda`` tests run the compiled kernel, the timed plan on the GPU and greedy decoding with the
plan against decoding without it.  The plan's choice is checked on CPU with given times."""

from __future__ import annotations

import pytest
import torch

from genserve.kernels.triton_gemv import MAX_ROWS, TILES, GemvTile, padded_rows
from genserve.model import gpu_gemv_plan
from genserve.model.gpu_gemv_plan import GemvChoice, GroupKey
from tests.utils.triton_interpreter import TritonInterpreter, needs_triton

# The interpreter rounds float32 → bfloat16 by truncation (one step at most, 2**-7
# relative); float32 outputs differ from the reference only in the order of the sums.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


def check_gemv(device: str = "cpu") -> None:
    """Every tile at 1-4 rows, ragged and even shapes, with and without a bias, rounded and
    float32 outputs.  Interpreted (CPU): float32 and float16 inputs, small shapes.  Compiled
    (GPU): bfloat16, an 8B model's O and down projections too; each combination of
    constants there is one more compilation, so bias and float32 output with one tile."""
    from genserve.kernels import triton_attention
    from genserve.kernels.triton_gemv import gemv, reference

    dev = torch.device(device)
    assert triton_attention.available(dev)  # the kernel, not the reference (CPU: interpreted)
    gen = torch.Generator().manual_seed(0)
    interpreted = device == "cpu"
    # (N, K): ragged N and K, K shorter than a tile, a K that no tile divides; on the GPU an
    # 8B model's O projection and a long down projection.
    shapes = [(40, 64), (37, 300), (130, 1030)]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16)
    if not interpreted:
        shapes, dtypes = [(37, 300), (4096, 4096), (1024, 14336)], (torch.bfloat16,)
    for n, k in shapes:
        w_full = torch.randn(n, k + 8, generator=gen)  # a row stride wider than K
        for dtype in dtypes:
            weight = w_full[:, :k].to(dev, dtype).contiguous()
            bias = torch.randn(n, generator=gen).to(dev, dtype)
            for rows in range(1, MAX_ROWS + 1):
                x = torch.randn(rows, k + 3, generator=gen).to(dev, dtype)[:, :k]  # strided rows
                for tile in TILES:
                    every = interpreted or tile == TILES[0]
                    for b in (None, bias) if every else (None,):
                        for out_dtype in {dtype, torch.float32} if every else {dtype}:
                            got = gemv(x, weight, b, tile, out_dtype)
                            want = reference(x, weight, b, out_dtype)
                            atol, rtol = TOLERANCE[out_dtype]
                            what = f"{n}x{k} {dtype} {rows} rows {tile} bias {b is not None}"
                            assert got.shape == (rows, n) and got.dtype == out_dtype, what
                            torch.testing.assert_close(
                                got, want, atol=atol * k**0.5, rtol=rtol, msg=what
                            )
    # Through the layers' entry point: the launch, rounded or float32 as the choice says.
    half = dtypes[-1]
    x = torch.randn(2, 64, generator=gen).to(dev, half)
    w = torch.randn(40, 64, generator=gen).to(dev, half)
    for out_float32 in (False, True):
        got = GemvChoice((TILES[0],) * MAX_ROWS, out_float32).run(x, w, None, TILES[0])
        want = reference(x, w, None, torch.float32 if out_float32 else half)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@needs_triton
def test_gemv_matches_its_reference(triton_interpreter: TritonInterpreter) -> None:
    triton_interpreter.run("from tests.unit.test_triton_gemv import check_gemv; check_gemv()")


def test_padded_rows() -> None:
    assert [padded_rows(r) for r in range(1, MAX_ROWS + 1)] == [1, 2, 4, 4]
    with pytest.raises(ValueError):
        padded_rows(MAX_ROWS + 1)


class _Proj:
    def __init__(self, n: int, k: int, bias: bool = False) -> None:
        self.weight = torch.empty(n, k, dtype=torch.bfloat16)
        self.bias = torch.empty(n, dtype=torch.bfloat16) if bias else None
        self.gpu_gemv: GemvChoice | None = None


def test_plan_takes_a_tile_only_where_it_beats_cublas_by_the_margin() -> None:
    """Given times (a fake clock: the choice, not the GPU, is under test): the QKV group's tile
    wins at one and two rows and loses at four; the MLP's never beats cuBLAS by the margin; the
    head's wins everywhere.  Two and four rows try only one row's winner."""
    qkv = [_Proj(96, 1024, bias=True) for _ in range(3)]
    mlp = [_Proj(128, 1024) for _ in range(3)]
    head = _Proj(500, 1024)
    groups = {
        GroupKey(96, 1024, torch.bfloat16, True, False): list(qkv),
        GroupKey(128, 1024, torch.bfloat16, False, False): list(mlp),
        GroupKey(500, 1024, torch.bfloat16, False, True): [head],
    }
    winner = TILES[1]
    asked: list[tuple[int, int, GemvTile | None]] = []

    def clock(key, rows, tile, weights, biases):  # type: ignore[no-untyped-def]
        asked.append((key.n, rows, tile))
        assert len(weights) == len(biases) == len(groups[key])
        assert all(b is None for b in biases) if key.out_float32 or not key.has_bias else True
        if tile is None:
            return 10.0
        if key.n == 128:
            return 9.8  # 2% faster: inside the margin
        fast = 7.0 if tile == winner else 9.0
        return 11.0 if key.n == 96 and rows == 4 else fast

    records = gpu_gemv_plan.choose(groups, clock)  # type: ignore[arg-type]
    assert [p.gpu_gemv for p in qkv] == [GemvChoice((winner, winner, None, None))] * 3
    assert all(p.gpu_gemv is None for p in mlp)
    assert head.gpu_gemv == GemvChoice((winner,) * MAX_ROWS, out_float32=True)
    assert {t for n, rows, t in asked if rows > 1 and t is not None and n != 128} == {winner}
    assert len(records) == 3 and records[1]["tiles"] == ["cublas"] * MAX_ROWS
    choice = qkv[0].gpu_gemv
    assert choice is not None and choice.tile_for(2) == winner and choice.tile_for(5) is None


def test_group_keeps_only_half_precision_cuda_matrices() -> None:
    """CPU weights (and float32 ones) are never planned: the kernel serves CUDA steps."""
    assert gpu_gemv_plan.group([_Proj(8, 8)], _Proj(8, 8)) == {}


@pytest.mark.cuda
def test_gemv_matches_its_reference_on_the_gpu() -> None:
    check_gemv("cuda")


@pytest.mark.cuda
def test_plan_on_the_gpu_and_the_tiles_inside_graphs(tiny_model_factory) -> None:  # type: ignore[no-untyped-def]
    """The timed plan runs on a bfloat16 model (a record for each projection shape and the
    head); then, with every projection forced onto a tile, the runner captures its graphs
    and overlapped scheduling changes no output (``_both`` compares the two)."""
    from genserve.model.loader import ResolvedModel
    from genserve.tokenizer import Tokenizer
    from genserve.worker.model_runner import ModelRunner
    from tests.unit.test_overlap_model import _both, _requests

    model_dir = tiny_model_factory("llama")
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)), torch.bfloat16, torch.device("cuda")
    )
    records = runner.model.use_gpu_gemv()
    timed = [r["rows1_cublas_us"] for r in records]
    assert len(records) >= 4 and all(isinstance(t, float) and t > 0 for t in timed), records
    forced = GemvChoice((TILES[0],) * MAX_ROWS)
    for layer in runner.model._layers:
        for proj in runner.model._linears(layer):
            proj.gpu_gemv = forced
    runner.model.lm_head.gpu_gemv = GemvChoice((TILES[0],) * MAX_ROWS, out_float32=True)
    runner.enable_cuda_graphs((1, 2, 4, 8), 1024, 16)
    runner.initialize_kv_cache(64, 16)
    runner.warmup()
    assert runner.cuda_graph_sizes == (1, 2, 4, 8), "capture failed: see the warning logged"
    _, _, on_runner = _both(runner, Tokenizer(model_dir), _requests, block_size=16)
    assert on_runner.placeholders > 20
    runner.shutdown()


@needs_triton
@pytest.mark.parametrize("rows", [1, 4])
def test_kernel_compiles_for_hopper_without_a_gpu(rows: int) -> None:
    """What the interpreter does not see (loop-carried types, a row count of 1 specialised
    to a constant): every tile compiled for sm_90 by Triton's own ptxas, no GPU needed, with
    the weight read in 16-byte vectors, given the alignment Triton's launcher finds at run
    time (pointers, row strides and ``K`` divisible by 16, as for every model's matrices)."""
    import inspect

    import triton

    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    from genserve.kernels import triton_gemv

    kernel = triton_gemv._kernel()
    names = list(inspect.signature(kernel.fn).parameters)
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*fp32"}
    aligned = [n for n in names if n.endswith(("_ptr", "_stride")) or n == "k"]
    for tile in TILES:
        constants: dict[str, object] = {
            "HAS_BIAS": False,
            "EVEN_K": True,
            "ROWS": padded_rows(rows),
            "BLOCK_N": tile.block_n,
            "BLOCK_K": tile.block_k,
        }
        if rows == 1:
            constants["rows"] = 1  # Triton specialises an argument of 1 to a constant
        signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
        source = compiler.ASTSource(
            fn=kernel,
            signature=signature,
            constexprs={(names.index(n),): v for n, v in constants.items()},
            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
        )
        compiled = triton.compile(
            source, target=backends.GPUTarget("cuda", 90, 32), options={"num_warps": tile.warps}
        )
        assert len(compiled.asm["cubin"]) > 0, str(tile)
        assert "ld.global.v4" in compiled.asm["ptx"], f"{tile}: W not read in 16-byte vectors"


def test_the_plan_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GENSERVE_GPU_GEMV=off`` (the A/B against cuBLAS alone); anything else plans."""
    for value, on in (("off", False), ("0", False), ("OFF", False), ("auto", True), ("", True)):
        monkeypatch.setenv("GENSERVE_GPU_GEMV", value)
        assert gpu_gemv_plan.enabled() is on, value
    monkeypatch.delenv("GENSERVE_GPU_GEMV")
    assert gpu_gemv_plan.enabled()
