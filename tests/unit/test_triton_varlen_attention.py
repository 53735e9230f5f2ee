"""genserve's Triton whole-step paged attention (``kernels/triton_varlen_attention.py``, the
CUDA path of steps with prompt rows, issue #29), run on CPU through Triton's interpreter
(``TRITON_INTERPRET=1``): against SDPA per sequence on its gathered K/V (float64) for mixes
of decode rows, fresh prompts and chunks continuing from the cache; and inside the model, a
mixed step through ``--gpu-prefill-attention triton`` against the SDPA path.  The ``cuda``
tests run the compiled kernel against the same reference and the server's runner against
transformers' greedy output.

The interpreter must be switched on before Triton is imported, so the interpreted checks run
in another process: the session's ``triton_interpreter`` (tests/utils/triton_interpreter.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TinyModelFactory
from tests.utils.triton_interpreter import TritonInterpreter, needs_triton


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64, one sequence at a time: gather its blocks, expand K/V to the query heads,
    SDPA with the causal (and window) mask; soft-capping and sinks written out."""
    _, num_kv_heads, _, block_size, head_dim = cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    outs, row = [], 0
    for i, (n_q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = table[i, : -(-n // block_size)].cpu()
        ctx = cache.cpu()[:, :, blocks].reshape(2, num_kv_heads, -1, head_dim)[:, :, :n].double()
        k = ctx[0].repeat_interleave(group, 0)  # [heads, n, hd]
        v = ctx[1].repeat_interleave(group, 0)
        q_i = q[row : row + n_q].cpu().double().transpose(0, 1)  # [heads, n_q, hd]
        q_pos = torch.arange(n - n_q, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        if softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(q_i, k, v, attn_mask=allowed, scale=scale)
        else:
            scores = q_i @ k.transpose(1, 2) * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                sink = sinks.cpu().double()[:, None, None].expand(num_heads, n_q, 1)
                scores = torch.cat([scores, sink], dim=-1)
            weights = scores.softmax(-1)[..., :n]
            o = weights @ v
        outs.append(o.transpose(0, 1))
        row += n_q
    return torch.cat(outs)


def _batch(query_lens: list[int], seq_lens: list[int], table: torch.Tensor) -> object:
    from genserve.kernels.triton_varlen_attention import VarlenBatch

    dev = table.device
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(query_lens)])).to(dev)
    return VarlenBatch(
        starts, torch.tensor(seq_lens, device=dev), table, sum(query_lens), len(query_lens)
    )


# (query_lens, seq_lens): decode rows (1 query), fresh prompts (query = context) and chunks
# continuing from the cache (query < context), in the step's order (decodes first).
MIXES = [
    ([1, 1, 1, 7, 5], [20, 1, 33, 7, 40]),  # decodes + a fresh prompt + a continuing chunk
    ([9, 16], [9, 50]),  # prefills only: a fresh prompt and a chunk after 34 cached tokens
    ([1, 1], [64, 17]),  # decodes only
]


def check_kernel(device: str = "cpu") -> None:
    from genserve.kernels import triton_varlen_attention as tva

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
    # (heads, kv_heads, head_dim, block_size, window, softcap, sinks): GQA 4/2 and 9/3 (a
    # group of three: five queries a tile), MQA, MHA with a head size that is no power of
    # two, 32-token blocks, sliding windows, soft-capping, attention sinks.
    shapes = [
        (4, 2, 16, 16, None, None, False),
        (9, 3, 32, 16, 6, None, False),
        (6, 1, 64, 32, None, 3.0, True),
        (4, 4, 24, 16, 20, 5.0, True),
    ]
    for heads, kv_heads, head_dim, block_size, window, softcap, use_sinks in shapes:
        for dtype, tol in tolerance.items():
            if dtype == torch.float16 and (softcap or window):  # one half dtype is enough
                continue
            num_blocks = 12
            cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen)
            cache = cache.to(dtype).to(dev)
            sinks = torch.randn(heads, generator=gen).to(dev) if use_sinks else None
            for query_lens, seq_lens in MIXES:
                width = -(-max(seq_lens) // block_size)
                table = torch.stack(
                    [torch.randperm(num_blocks, generator=gen)[:width] for _ in seq_lens]
                ).to(dev)
                q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
                q = q.to(dev)
                scale = head_dim**-0.5
                batch = _batch(query_lens, seq_lens, table)
                out = tva.paged_varlen_attention(
                    q,
                    cache,
                    batch,
                    scale,
                    window,
                    softcap,
                    sinks,  # type: ignore[arg-type]
                )
                want = reference(
                    q, cache, table, query_lens, seq_lens, scale, window, softcap, sinks
                )
                err = (out.cpu().double() - want).abs().max().item()
                what = (dtype, heads, kv_heads, head_dim, block_size, window, softcap, query_lens)
                assert out.dtype == dtype and out.shape == q.shape, what
                assert err < tol, (*what, err)
    # A view with a token stride wider than its heads (the fused QK projection's layout).
    qk = torch.randn(15, 6, 16, generator=gen).to(dev)
    cache = torch.randn(2, 2, 12, 16, 16, generator=gen).to(dev)
    table = torch.stack([torch.randperm(12, generator=gen)[:3] for _ in range(5)]).to(dev)
    lens = MIXES[0]
    out = tva.paged_varlen_attention(qk[:, :4], cache, _batch(*lens, table), 0.25)  # type: ignore[arg-type]
    want = reference(qk[:, :4], cache, table, *lens, 0.25, None)
    assert (out.cpu().double() - want).abs().max().item() < 1e-5


def check_model(model_dir: str, fused: str) -> None:
    """Prefill two prompts, then one mixed step (two decode rows, a fresh prompt, a chunk
    continuing the first prompt from the cache) through each prefill path: the Triton one's
    logits equal the SDPA path's (float32), and so do SDPA-pinned's.  ``fused``: "1" runs
    the model's fused GPU layer ops (Triton, interpreted) as CUDA does."""
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
        if fused == "1":
            model.use_fused_gpu_ops(config.max_position_embeddings)
        sdpa = TorchPagedAttention(cpu, batch_prompts=True)
        shape = sdpa.kv_cache_shape(16, block_size, model.num_local_kv_heads, config.head_dim)
        caches = [torch.zeros(shape) for _ in range(config.num_layers)]
        gen = torch.Generator().manual_seed(1)
        first = [(21, (3, 4)), (37, (9, 2, 12))]  # (prompt length, blocks)
        tokens = torch.randint(3, 1000, (sum(n for n, _ in first),), generator=gen)
        positions = torch.cat([torch.arange(n) for n, _ in first])
        seqs = [SeqSpec(n, 0, b) for n, b in first]
        model(tokens, positions, caches, sdpa.build(seqs, 0, block_size))
        # The mixed step: seq 1 decodes, seq 0 continues with a 14-token chunk (positions
        # 21..34), two fresh prompts of 6 and 40 tokens, and one more decode row.
        step = [
            SeqSpec(1, 37, (9, 2, 12)),
            SeqSpec(14, 21, (3, 4, 5)),
            SeqSpec(6, 0, (6,)),
            SeqSpec(40, 0, (7, 8, 10)),
        ]
        step_tokens = torch.randint(3, 1000, (61,), generator=gen)
        step_positions = torch.cat(
            [torch.tensor([37]), torch.arange(21, 35), torch.arange(6), torch.arange(40)]
        )

        def logits(backend: TorchPagedAttention) -> torch.Tensor:
            run = [c.clone() for c in caches]
            meta = backend.build(step, 1, block_size)
            return model.compute_logits(model(step_tokens, step_positions, run, meta))

        want = logits(sdpa)
        triton_backend = TorchPagedAttention(cpu, use_triton_decode=True, prefill="triton")
        assert triton_backend.name.endswith("+triton-prefill")
        got = logits(triton_backend)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        pinned = logits(TorchPagedAttention(cpu, batch_prompts=True, prefill="sdpa-pinned"))
        torch.testing.assert_close(pinned, want, atol=1e-5, rtol=1e-5)


@needs_triton
def test_kernel_matches_sdpa_per_sequence(triton_interpreter: TritonInterpreter) -> None:
    triton_interpreter.run(
        "from tests.unit.test_triton_varlen_attention import check_kernel; check_kernel()"
    )


@needs_triton
@pytest.mark.parametrize(
    ("arch", "fused"),
    [("llama", "1"), ("mistral", "0"), ("gemma2", "0")],
    ids=["llama-fused-ops", "mistral-window", "gemma2-softcap-window"],
)
def test_mixed_step_through_triton_equals_sdpa(
    tiny_model_factory: TinyModelFactory,
    triton_interpreter: TritonInterpreter,
    arch: str,
    fused: str,
) -> None:
    model_dir = tiny_model_factory(arch)
    triton_interpreter.run(
        "import sys; from tests.unit.test_triton_varlen_attention import check_model; "
        "check_model(sys.argv[1], sys.argv[2])",
        str(model_dir),
        fused,
    )


def test_tiles_cover_a_group_of_query_heads() -> None:
    from genserve.kernels.triton_varlen_attention import tile_rows

    assert tile_rows(1) == (16, 16)  # MHA: 16 queries a tile
    assert tile_rows(4) == (16, 4)  # Llama-3-8B's 32/8
    assert tile_rows(3) == (16, 5)  # 15 of 16 rows used
    assert tile_rows(32) == (32, 1)  # MQA with 32 heads: one query a tile


def test_flag_resolution() -> None:
    from genserve.model.attention_backend import resolve_prefill_attention

    cpu = torch.device("cpu")
    for flag in ("auto", "sdpa", "sdpa-pinned"):
        assert resolve_prefill_attention(flag, cpu, 16, torch.float32, 64) == "sdpa"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CUDA"):
        resolve_prefill_attention("triton", cpu, 16, torch.float32, 64)


def test_flag_on_cuda_without_a_usable_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA: ``triton`` where the kernel cannot run is refused with the reason; ``auto``
    falls back to SDPA; the SDPA values are taken as asked."""
    from genserve.kernels import triton_attention
    from genserve.model.attention_backend import resolve_prefill_attention

    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_attention, "_triton_installed_ok", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_prefill_attention("auto", cuda, 16, torch.bfloat16, 128) == "triton"
    assert resolve_prefill_attention("sdpa-pinned", cuda, 16, torch.bfloat16, 128) == "sdpa-pinned"
    assert resolve_prefill_attention("sdpa", cuda, 16, torch.bfloat16, 128) == "sdpa"
    assert resolve_prefill_attention("auto", cuda, 24, torch.bfloat16, 128) == "sdpa"
    with pytest.raises(ValueError, match="block size 24"):
        resolve_prefill_attention("triton", cuda, 24, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="latent attention"):
        resolve_prefill_attention("triton", cuda, 16, torch.bfloat16, 128, model_supported=False)
    monkeypatch.setattr(triton_attention, "_triton_installed_ok", lambda: False)
    assert resolve_prefill_attention("auto", cuda, 16, torch.bfloat16, 128) == "sdpa"


def test_step_metadata_is_one_upload() -> None:
    """Every array of a mixed step's metadata goes to the device in one copy, whatever the
    prefill path."""
    from genserve.model.attention import SeqSpec, TorchPagedAttention

    step = [
        SeqSpec(1, 20, (0, 1)),
        SeqSpec(7, 0, (2,)),
        SeqSpec(5, 30, (3, 4, 5)),
        SeqSpec(4, 0, (6,)),
    ]
    for prefill in ("sdpa", "sdpa-pinned", "triton"):
        uploads: list[torch.Tensor] = []

        def upload(host: torch.Tensor, seen: list[torch.Tensor] = uploads) -> torch.Tensor:
            seen.append(host)
            return host.clone()

        backend = TorchPagedAttention(
            torch.device("cpu"),
            batch_prompts=True,
            prefill=prefill,
            upload=upload,  # type: ignore[arg-type]
        )
        meta = backend.build(step, 1, 16)
        assert len(uploads) == 1, prefill
        assert meta.slots.tolist()[:2] == [1 * 16 + 4, 2 * 16]  # type: ignore[attr-defined]
        varlen = meta.varlen  # type: ignore[attr-defined]
        if prefill == "triton":
            assert varlen.query_start.tolist() == [0, 1, 8, 13, 17]
            assert varlen.seq_lens.tolist() == [21, 7, 35, 4]
            assert varlen.block_table.tolist()[2] == [3, 4, 5]
            assert (varlen.num_tokens, varlen.num_seqs) == (17, 4)
            assert meta.fresh is None  # type: ignore[attr-defined]
        else:
            assert varlen is None
            assert meta.fresh is not None and meta.fresh.rows.tolist() == [  # type: ignore[attr-defined]
                1, 2, 3, 4, 5, 6, 7, 13, 14, 15, 16,
            ]  # fmt: skip


# ------------------------------------------------------------------------------- on a GPU
@pytest.mark.cuda
def test_compiled_kernel_matches_sdpa_per_sequence_on_the_gpu() -> None:
    check_kernel("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("prefill", ["triton", "sdpa-pinned", "sdpa"])
def test_greedy_output_per_prefill_path_equals_transformers_on_the_gpu(
    tiny_model_factory: TinyModelFactory, prefill: str
) -> None:
    """The runner with ``--gpu-prefill-attention`` set (float32, decode steps replayed from
    CUDA graphs, every step with prompt rows through the chosen path) over the GPU tests'
    mixed workload — prompts of 1 to 130 tokens arriving into running batches, a prefix-cache
    hit (a chunk continuing from cached blocks), a preemption: greedy tokens equal
    transformers' ``generate``."""
    from genserve.model.loader import ResolvedModel
    from genserve.worker.model_runner import ModelRunner
    from tests.unit.test_cuda_gpu import SIZES, _mixed_workload, hf_greedy_cuda
    from tests.unit.test_model_runner import BLOCK_SIZE, NUM_BLOCKS, Driver

    model_dir = tiny_model_factory("llama")
    runner = ModelRunner(
        ResolvedModel(model_dir, str(model_dir)),
        torch.float32,
        torch.device("cuda"),
        prefill_attention=prefill,  # type: ignore[arg-type]
    )
    runner.enable_cuda_graphs(SIZES, 1024, BLOCK_SIZE)
    runner.initialize_kv_cache(NUM_BLOCKS, BLOCK_SIZE)
    runner.warmup()
    assert runner.backend is not None
    suffix = {"triton": "+triton-prefill", "sdpa-pinned": "+pinned-prefill", "sdpa": "-decode"}
    assert runner.backend.name.endswith(suffix[prefill]), runner.backend.name
    reqs = _mixed_workload(Driver(runner, budget=48))
    for req in reqs:
        expected = hf_greedy_cuda(model_dir, req.tokens[: req.num_prompt], req.max_new)
        assert [s.token_id for s in req.out] == expected, (prefill, req.req_id)
    runner.shutdown()


def test_micro_benchmark_runs_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """scripts/gpu-check.sh's mixed-attn stage, tiny and on the CPU (SDPA paths: the Triton
    one needs the interpreter there), so the GPU call does not fail on the script itself."""
    from genserve.bench.mixed_attention import main

    args = (
        "--device cpu --dtype float32 --paths sdpa,sdpa-pinned --decodes 3 --context 40 "
        "--prompts 2 --prompt-len 5 --chunk 6 --chunk-after 17 --heads 4 --kv-heads 2 "
        "--head-dim 16 --iters 2 --builds 2"
    )
    main(args.split())
    out = capsys.readouterr().out
    assert "3 decode rows" in out and "19 rows" in out
    lines = [line.split() for line in out.splitlines()[2:]]
    assert [line[0] for line in lines] == ["sdpa", "sdpa-pinned"]
    assert all(line[1] == "-" and float(line[2]) > 0 for line in lines)


@needs_triton
@pytest.mark.parametrize(
    ("dtype", "options"),
    [("bf16", False), ("fp32", True)],
    ids=["bf16-gqa4-one-sequence", "fp32-window-softcap-sinks"],
)
def test_kernel_compiles_for_hopper_without_a_gpu(dtype: str, options: bool) -> None:
    """The interpreter checks the arithmetic but not what only the compiler sees (types of
    loop-carried values, a sequence count of 1 specialised to a constant): compile the
    kernel ahead of time for sm_90 with Triton's own ptxas, no GPU needed."""
    import inspect

    import triton

    compiler = pytest.importorskip("triton.compiler")
    backends = pytest.importorskip("triton.backends.compiler")
    from genserve.kernels import triton_varlen_attention as tva

    kernel = tva._kernel()
    names = list(inspect.signature(kernel.fn).parameters)
    pointers = {"table_ptr": "*i64", "qstart_ptr": "*i64", "lens_ptr": "*i64"}
    pointers |= {"sinks_ptr": "*fp32", "scale": "fp32", "softcap": "fp32"}
    pointers |= {n: f"*{dtype}" for n in ("q_ptr", "cache_ptr", "out_ptr")}
    group, head_dim = (4, 128) if dtype == "bf16" else (3, 80)
    block_m, block_q = tva.tile_rows(group)
    constants: dict[str, object] = {
        "GROUP": group,
        "BLOCK_M": block_m,
        "BLOCK_Q": block_q,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": 16,
        "USE_WINDOW": options,
        "USE_SOFTCAP": options,
        "USE_SINKS": options,
        "PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    if not options:
        constants["num_seqs"] = 1  # what Triton's specialisation of a 1 argument makes
    signature = {
        n: "constexpr" if n in constants else pointers.get(n, "i64" if "stride" in n else "i32")
        for n in names
    }
    source = compiler.ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
    )
    compiled = triton.compile(source, target=backends.GPUTarget("cuda", 90, 32))
    assert len(compiled.asm["cubin"]) > 0
