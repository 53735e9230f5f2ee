"""The Triton mixture-of-experts kernels (``kernels/triton_moe.py``, the CUDA path of
``model/moe.py``) against the torch expert loop they replace.

On CPU through Triton's interpreter (``TRITON_INTERPRET=1``, in the session's
``triton_interpreter`` process, as in ``test_triton_fused.py``; skipped where triton is not
installed): the kernels equal ``experts_torch`` at 1 row, a few rows and tall tiles,
SiLU-gated and gpt-oss's clamped SwiGLU with biases, float32 and bfloat16; inside every
native MoE family's decoder (softmax and sigmoid routing, gated and ungated shared experts,
expert biases) the logits with the routed experts on the kernels equal the torch loop's and
transformers'.  The alignment
(``align_by_expert``) is plain torch and is checked directly.

Marked ``cuda`` (scripts/gpu-check.sh's ``tests`` stage runs them on a GPU): the compiled
kernels against the torch loop at a Qwen3-30B-A3B expert shape and gpt-oss's activation, and
a MoE model's float32 greedy tokens equal transformers' on CUDA, eager and with CUDA graphs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from genserve.kernels.triton_moe import align_by_expert, tile_height
from genserve.model.moe import experts_torch
from genserve.model.spec import ClampedSwiGLU
from genserve.testing.tiny_model import default_tokenizer_dir
from tests.utils.moe_models import MOE_FAMILIES, make_moe_model
from tests.utils.triton_interpreter import TritonInterpreter, needs_triton

# float32: summation order only; bfloat16: the interpreter truncates float32 → bfloat16 (a
# GPU rounds to nearest) and the loop rounds once per choice where the kernel rounds a
# token's sum once: a few bfloat16 steps.
TOLERANCE = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (8e-2, 4e-2)}
GPT_OSS = (1.702, 1.5)  # gpt-oss's alpha, and a limit random activations reach


def _operands(
    num_tokens: int, top_k: int, experts: int, hidden: int, width: int, dtype: torch.dtype,
    bias: bool, device: str = "cpu", seed: int = 0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    w13 = torch.randn(experts, 2 * width, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, width, generator=gen) * width**-0.5
    b13 = torch.randn(experts, 2 * width, generator=gen) if bias else None
    b2 = torch.randn(experts, hidden, generator=gen) if bias else None

    def to(t: torch.Tensor | None, float_dtype: torch.dtype) -> torch.Tensor | None:
        return None if t is None else t.to(device=device, dtype=float_dtype)

    return (
        to(x, dtype), ids.to(device), weights.to(device), to(w13, dtype), to(w2, dtype),
        to(b13, dtype), to(b2, dtype),
    )  # fmt: skip


def check_kernels_match_the_loop(device: str = "cpu") -> None:
    """The kernels against ``experts_torch`` over shapes that exercise one row, ragged
    tiles, widths off the tile, tall (64-row) tiles, and experts no row chose."""
    from genserve.kernels import triton_moe

    cases = [
        # tokens, top_k, experts, hidden, width
        (1, 2, 8, 64, 32),
        (5, 2, 8, 40, 24),
        (3, 1, 4, 100, 72),
        (40, 2, 4, 48, 16),  # 80 pairs >= 8 per expert: 64-row tiles
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for tokens, top_k, experts, hidden, width in cases:
            for gpt_oss in (False, True):
                x, ids, w, w13, w2, b13, b2 = _operands(
                    tokens, top_k, experts, hidden, width, dtype, gpt_oss, device
                )
                assert w13 is not None and w2 is not None and x is not None
                assert triton_moe.supports(x, w13, w2) is None
                clamp = GPT_OSS if gpt_oss else None
                got = triton_moe.fused_experts(x, ids, w, w13, w2, b13, b2, clamp)
                act = ClampedSwiGLU(*GPT_OSS) if gpt_oss else None
                want = experts_torch(x, ids, w, w13, w2, b13, b2, act)
                atol, rtol = TOLERANCE[dtype]
                what = f"{dtype} {tokens}x{top_k} of {experts}, {hidden}/{width}, {gpt_oss=}"
                torch.testing.assert_close(
                    got, want, atol=atol, rtol=rtol, msg=lambda m, what=what: f"{what}: {m}"
                )


def check_family_logits(family: str, model_dir: str) -> None:
    """A family's decoder with its routed experts on the kernels: logits equal the torch
    loop's (and both equal transformers')."""
    from transformers import AutoModelForCausalLM

    from genserve.kernels import fused_gpu_ops
    from genserve.model.attention import SeqSpec, TorchPagedAttention
    from genserve.model.config import load_model_config
    from genserve.model.moe import SparseMoeBlock
    from genserve.model.registry import build_model
    from genserve.model.weights import SafetensorsWeights
    from genserve.parallel import ParallelContext

    cpu = torch.device("cpu")
    assert fused_gpu_ops.triton_runs(cpu)  # interpreted: the kernels, not the loop
    config = load_model_config(Path(model_dir))
    model = build_model(config, ParallelContext.single(), torch.float32, cpu)
    with SafetensorsWeights(Path(model_dir)) as weights:
        model.load_weights(weights)
    num_tokens = 24
    ids = torch.randint(3, 40000, (num_tokens,), generator=torch.Generator().manual_seed(0))
    backend = TorchPagedAttention(cpu)
    shape = backend.kv_cache_shape(4, 16, model.num_local_kv_heads, config.head_dim)
    meta = backend.build([SeqSpec(num_tokens, 0, tuple(range(4)))], 0, 16)

    def logits() -> torch.Tensor:
        caches = [torch.zeros(shape) for _ in range(config.num_layers)]
        return model.compute_logits(model(ids, torch.arange(num_tokens), caches, meta))

    with torch.inference_mode():
        loop = logits()
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert blocks
        for block in blocks:
            assert block.use_fused_gpu_ops() is None
            assert block.gpu_fused
        fused = logits()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        want = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(fused, loop, atol=1e-4, rtol=1e-4, msg=lambda m: f"{family}: {m}")
    torch.testing.assert_close(fused, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"{family}: {m}")


# ------------------------------------------------------------------------------ CPU tests
@pytest.mark.parametrize("num_tokens", [1, 3, 50])
def test_alignment_groups_pairs_by_expert_in_padded_runs(num_tokens: int) -> None:
    experts, top_k = 8, 2
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    block = tile_height(num_tokens * top_k, experts)
    pairs, block_expert = align_by_expert(ids, experts, block)
    num_pairs = num_tokens * top_k
    assert pairs.numel() == block_expert.numel() * block
    assert pairs.numel() >= num_pairs + min(experts, num_pairs) * (block - 1)
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    flat = ids.reshape(-1)
    for tile, expert in enumerate(block_expert.tolist()):
        members = pairs[tile * block : (tile + 1) * block]
        members = members[members < num_pairs]
        if expert == experts:  # past the last run: nothing in it
            assert members.numel() == 0
            continue
        assert (flat[members.long()] == expert).all()
        assert members.tolist() == sorted(members.tolist())  # pair order kept within a run
    used = block_expert[block_expert < experts]
    assert used.tolist() == sorted(used.tolist())
    # Each expert's run is as long as its count, padded up to whole tiles.
    counts = torch.bincount(flat, minlength=experts)
    tiles = torch.bincount(used.long(), minlength=experts)
    assert (tiles == (counts + block - 1) // block).all()


def test_supports_names_what_goes_to_the_loop() -> None:
    from genserve.kernels import triton_moe

    x, _, _, w13, w2, _, _ = _operands(2, 2, 4, 32, 16, torch.float32, False)
    assert x is not None and w13 is not None and w2 is not None
    assert triton_moe.supports(x, w13, w2) is None
    assert triton_moe.supports(x.double(), w13.double(), w2.double()) == "dtype torch.float64"
    assert "different dtypes" in str(triton_moe.supports(x, w13.half(), w2))
    assert "non-contiguous" in str(triton_moe.supports(x, w13.transpose(1, 2), w2))


@needs_triton
def test_kernels_match_the_torch_loop_interpreted(triton_interpreter: TritonInterpreter) -> None:
    triton_interpreter.run(
        "from tests.unit.test_triton_moe import check_kernels_match_the_loop as c; c()"
    )


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("triton-moe")
    tok = default_tokenizer_dir()
    return {f: make_moe_model(root / f, f, tok, seed=5) for f in MOE_FAMILIES}


@needs_triton
def test_family_logits_with_triton_experts_interpreted(
    moe_dirs: dict[str, Path], triton_interpreter: TritonInterpreter
) -> None:
    # Every family in one check: the families' models are built once, in this process.
    args = [str(moe_dirs[family]) for family in sorted(MOE_FAMILIES)]
    triton_interpreter.run(
        "import sys; from tests.unit.test_triton_moe import check_family_logits as c\n"
        "for d in sys.argv[1:]: c(d.rsplit('/', 1)[1], d)",
        *args,
    )


# ------------------------------------------------------------------------------ GPU tests
@pytest.mark.cuda
def test_compiled_kernels_match_the_torch_loop_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from genserve.kernels import triton_moe

    check_kernels_match_the_loop("cuda")
    # Qwen3-30B-A3B's expert shape (128 experts, top-8, hidden 2048, width 768), bfloat16,
    # at decode and prefill sizes; float32 at a smaller width (IEEE products, no TF32).
    for dtype, width, sizes in (
        (torch.bfloat16, 768, (1, 8, 64, 300)),
        (torch.float32, 256, (1, 33)),
    ):
        for num_tokens in sizes:
            x, ids, w, w13, w2, _, _ = _operands(
                num_tokens, 8, 128, 2048, width, dtype, False, "cuda", seed=num_tokens
            )
            assert x is not None and w13 is not None and w2 is not None
            got = triton_moe.fused_experts(x, ids, w, w13, w2)
            want = experts_torch(x, ids, w, w13, w2)
            # bfloat16: the loop rounds its output once per choice (8 here), the kernel once
            # (seen on an H100: 1 of 131,072 values 0.0217 apart at atol 0.02).
            atol, rtol = (5e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("family", "graphs"),
    # gpt-oss's attention sinks decode eagerly (no graphs for it, with or without MoE).
    [("qwen2_moe", False), ("qwen2_moe", True), ("glm4_moe", True), ("gpt_oss", False)],
)
def test_moe_float32_greedy_matches_transformers_on_cuda(
    family: str, graphs: bool, moe_dirs: dict[str, Path]
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from transformers import AutoConfig

    from genserve.model.moe import SparseMoeBlock
    from tests.unit.test_cuda_gpu import cuda_runner, hf_greedy_cuda
    from tests.unit.test_model_runner import Driver, random_prompts

    model_dir = moe_dirs[family]
    if family == "gpt_oss" and not hasattr(AutoConfig.from_pretrained(model_dir), "swiglu_alpha"):
        pytest.skip("this transformers' GptOssConfig has no swiglu_alpha (seen with 5.17)")
    runner = cuda_runner(model_dir, torch.float32, graphs=graphs)
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.gpu_fused for b in blocks)
    driver = Driver(runner, budget=48)
    reqs = [driver.add(f"r{i}", p, 12) for i, p in enumerate(random_prompts([3, 40, 95], seed=7))]
    driver.run()
    for req in reqs:
        expected = hf_greedy_cuda(model_dir, req.tokens[: req.num_prompt], req.max_new)
        assert [s.token_id for s in req.out] == expected, (family, req.req_id)
