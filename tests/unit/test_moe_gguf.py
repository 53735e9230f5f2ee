"""The quantized expert op ``genserve::moe_experts_gguf`` (kernels/moe_quant_cpu.cpp) against
its torch reference (gguf-py's dequantizer on the chosen experts, model/moe_gguf.py), the GGUF
names of mixture-of-experts tensors (model/gguf_names.py), and a MoE GGUF loaded with its
experts kept as the file's blocks (no float ``w13``/``w2``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.model import gguf_names
from genserve.model.moe_gguf import PACKED_Q8_0, QuantizedExperts, experts_gguf_torch
from genserve.testing.tiny_gguf import random_blocks

needs_kernels = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")
MIXES = [
    ("Q8_0",) * 3,
    ("Q4_0",) * 3,
    ("MXFP4",) * 3,
    ("Q4_K", "Q4_K", "Q6_K"),
    ("Q5_K", "Q5_K", "Q8_0"),
]


def _blocks(qtype: str, experts: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    q = GGMLQuantizationType[qtype]
    if qtype in ("Q8_0", "Q4_0", "MXFP4"):
        rng = np.random.default_rng(seed)
        w = (0.1 * rng.standard_normal((experts, rows, cols))).astype(np.float32)
        return torch.from_numpy(np.array(quantize(w, q)))
    raw = random_blocks(q, experts * rows, cols, seed=seed)
    return torch.from_numpy(raw.reshape(experts, rows, -1).copy())


def _experts(types: tuple[str, ...], num: int = 8, hidden: int = 256, width: int = 256):
    gate = _blocks(types[0], num, width, hidden, 1)
    up = _blocks(types[1], num, width, hidden, 2)
    down = _blocks(types[2], num, hidden, width, 3)
    return QuantizedExperts(gate, up, down, (types[0], types[1], types[2]))


def _routing(rows: int, num: int = 8, top_k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    ids = torch.stack([torch.randperm(num, generator=gen)[:top_k] for _ in range(rows)])
    return ids, torch.rand(rows, top_k, generator=gen)


@needs_kernels
@pytest.mark.parametrize("types", MIXES, ids=["-".join(t) for t in MIXES])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_float_path_equals_the_dequantized_reference(types: tuple[str, ...], rows: int) -> None:
    experts = _experts(types)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(5))
    ids, weights = _routing(rows)
    expected = experts_gguf_torch(x, ids, weights, experts)
    got = experts.forward(x, ids, weights)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * scale)


@needs_kernels
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
@pytest.mark.parametrize("types", MIXES, ids=["-".join(t) for t in MIXES])
def test_integer_paths_agree_with_each_other_and_near_the_float_path(
    types: tuple[str, ...],
) -> None:
    """Every instruction set computes the same integer sums (results equal to float
    rounding); against the float path only the int8 rounding of the activations differs
    (measured ~1-2% relative on these random blocks, two roundings deep)."""
    experts = _experts(types)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(6))
    ids, weights = _routing(8)
    reference = experts.forward(x, ids, weights)
    results = [
        experts.serving(int(isa)).forward(x, ids, weights) for isa in int_dot.available_isas()
    ]
    for got in results:
        torch.testing.assert_close(got, results[0], rtol=1e-5, atol=1e-5 * got.abs().max().item())
        assert ((got - reference).norm() / reference.norm()).item() < 0.05


@needs_kernels
@pytest.mark.skipif(not int_dot.available_isas(), reason="no integer kernel path (no AVX2)")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "MXFP4"])
def test_integer_rows_do_not_depend_on_the_step(qtype: str) -> None:
    """A row's result is the same computed alone or in a step where its experts have other
    rows (the Q8_0/Q4_0 rows run four weight rows at a time, an expert's activation rows one
    after the other over them): equal, not close, on every instruction set; and the input
    quantized once per token gives what quantizing it per chosen expert gave (the two top-k
    slots of a token see the same int8 row)."""
    experts = _experts((qtype,) * 3, hidden=256, width=96)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(7))
    ids, weights = _routing(9)
    ids[1] = ids[0]  # two tokens on the same two experts: an expert with two rows
    for isa in int_dot.available_isas():
        serving = experts.serving(int(isa))
        together = serving.forward(x, ids, weights)
        for t in range(9):
            alone = serving.forward(x[t : t + 1], ids[t : t + 1], weights[t : t + 1])
            assert torch.equal(together[t : t + 1], alone), (isa, t)


@needs_kernels
@pytest.mark.skipif(
    int_dot.Isa.AVX512_VNNI not in int_dot.available_isas(), reason="no AVX512-VNNI path"
)
def test_q8_0_experts_packed_in_groups_of_16_on_the_avx512_vnni_path() -> None:
    """Q8_0 experts served on AVX512-VNNI are repacked (groups of 16 rows, same bytes
    rearranged: the pack is undone exactly) and give the plain Q8_0 rows' results to float
    rounding on 1-40 rows, including a row count per expert past the 4-row tile; any other
    path gets the file's layout back."""
    experts = _experts(("Q8_0",) * 3)
    packed = experts.serving(int(int_dot.Isa.AVX512_VNNI))
    assert packed.types == (PACKED_Q8_0,) * 3
    assert packed.nbytes == experts.nbytes
    assert not torch.equal(packed.gate, experts.gate)
    back = packed.serving(int(int_dot.Isa.AVX2))
    assert back.types == ("Q8_0",) * 3
    for a, b in ((back.gate, experts.gate), (back.up, experts.up), (back.down, experts.down)):
        assert torch.equal(a, b)
    plain = experts.serving(int(int_dot.Isa.AVX2))
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        ids, weights = _routing(rows)
        expected = plain.forward(x, ids, weights)
        got = packed.forward(x, ids, weights)
        torch.testing.assert_close(
            got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item()
        )
    with pytest.raises(RuntimeError, match="packed in groups of 16"):
        torch.ops.genserve.moe_experts_gguf(
            x, ids, weights, packed.gate, packed.up, packed.down, packed.codes, -1
        )


@needs_kernels
def test_q8_0_pack_layout_is_the_documented_permutation() -> None:
    """``moe_pack_q8_0_r16`` against the layout moe_q8_r16_row.inc documents, built
    independently in numpy: per group of 16 rows, block b's quants at 512 b + 64 t + 4 r + i
    (quad t, row r, input 4 t + i) as q + 128, then the 16 rows' float16 scales per block;
    and ``unpack`` gives the file's bytes back (any bytes: the pack is a permutation)."""
    rng = np.random.default_rng(7)
    experts, rows, nb = 3, 32, 5
    plain = rng.integers(0, 256, (experts, rows, nb * 34), dtype=np.uint8)
    blocks = plain.reshape(experts, rows // 16, 16, nb, 34)
    quants = blocks[..., 2:].reshape(experts, rows // 16, 16, nb, 8, 4) ^ 0x80
    # [E, G, row, block, quad, i] -> [E, G, block, quad, row, i]
    packed_q = quants.transpose(0, 1, 3, 4, 2, 5).reshape(experts, rows // 16, nb * 512)
    # [E, G, row, block, 2] -> [E, G, block, row, 2]
    scales = blocks[..., :2].transpose(0, 1, 3, 2, 4).reshape(experts, rows // 16, nb * 32)
    expected = np.concatenate([packed_q, scales], axis=2).reshape(experts, rows, nb * 34)
    got = torch.ops.genserve.moe_pack_q8_0_r16(torch.from_numpy(plain))
    assert np.array_equal(got.numpy(), expected)
    back = torch.ops.genserve.moe_pack_q8_0_r16(got, True)
    assert np.array_equal(back.numpy(), plain)


def _gpt_oss_extras(num: int, hidden: int, width: int):  # type: ignore[no-untyped-def]
    """gpt-oss's expert biases, wide enough that the SwiGLU limit (2.0 here) clamps."""
    from genserve.model.spec import ClampedSwiGLU

    gen = torch.Generator().manual_seed(11)
    b13 = 3.0 * torch.randn(num, 2 * width, generator=gen)
    b2 = torch.randn(num, hidden, generator=gen)
    return b13, b2, ClampedSwiGLU(1.702, 2.0)


@needs_kernels
@pytest.mark.parametrize("types", [("MXFP4",) * 3, ("Q8_0",) * 3, ("Q4_K", "Q4_K", "Q6_K")])
@pytest.mark.parametrize("rows", [1, 7])
def test_gpt_oss_biases_and_clamp_equal_the_reference(types: tuple[str, ...], rows: int) -> None:
    """The op's optional gpt-oss arguments (b13, b2, clamped SwiGLU) on the float path equal
    the torch loop on the dequantized blocks; dropping the clamp or either bias changes the
    result, so the comparison covers each; the integer paths stay near the float path."""
    experts = _experts(types)
    b13, b2, clamped = _gpt_oss_extras(8, 256, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows + 20))
    ids, weights = _routing(rows)
    expected = experts_gguf_torch(x, ids, weights, experts, b13, b2, clamped)
    got = experts.forward(x, ids, weights, b13, b2, clamped)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5 * scale)
    for variant in ((None, b2, clamped), (b13, None, clamped), (b13, b2, None)):
        other = experts_gguf_torch(x, ids, weights, experts, *variant)
        assert (other - expected).abs().max().item() > 1e-2 * scale
    for isa in int_dot.available_isas():
        integer = experts.serving(int(isa)).forward(x, ids, weights, b13, b2, clamped)
        assert ((integer - expected).norm() / expected.norm()).item() < 0.05


@needs_kernels
def test_mxfp4_float_path_decodes_as_gguf_py() -> None:
    """The op's MXFP4 float path decodes every nibble and exponent byte (0 and 1: the
    subnormal 2^-128 / 2^-127 scales, up to 240) to gguf-py's dequantized value exactly.
    Each call reads one column j of an MXFP4 down projection: gate/up weights zero, gate
    bias 128 and up bias 0 at j only, no clamp reached (limit 1e9), so the activation is
    exactly 128 at j (sigmoid(1.702 * 128) is 1 in float32) and 0 elsewhere, and the output
    is 128 W[:, j], exact in float32."""
    from gguf import GGMLQuantizationType, dequantize
    from gguf.quants import quantize

    from genserve.model.spec import ClampedSwiGLU

    hidden, width = 32, 64
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (1, hidden, width // 32 * 17), dtype=np.uint8)
    raw[0, :, 0] = np.arange(hidden) * 7  # exponent bytes 0, 7, ..., 217 (block 0)
    raw[0, :, 17] = np.arange(hidden) % 2 + np.where(np.arange(hidden) < 16, 0, 224)
    values = dequantize(raw[0], GGMLQuantizationType.MXFP4).reshape(hidden, width)
    zero = np.asarray(quantize(np.zeros((1, width, hidden), np.float32), GGMLQuantizationType.Q8_0))
    experts = QuantizedExperts(
        torch.from_numpy(zero.copy()), torch.from_numpy(zero.copy()), torch.from_numpy(raw),
        ("Q8_0", "Q8_0", "MXFP4"),
    )  # fmt: skip
    x, ids, weights = torch.zeros(1, hidden), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    for j in range(width):
        b13 = torch.zeros(1, 2 * width)
        b13[0, j] = 128.0
        out = experts.forward(x, ids, weights, b13, None, ClampedSwiGLU(1.702, 1e9))
        assert np.array_equal(out[0].numpy(), 128.0 * values[:, j]), j


@needs_kernels
def test_bad_inputs_are_refused() -> None:
    experts = _experts(("Q8_0",) * 3)
    x = torch.randn(2, 256)
    ids, weights = _routing(2)
    with pytest.raises(RuntimeError, match="out of range"):
        experts.forward(x, ids + 100, weights)
    with pytest.raises(RuntimeError, match="GGML type"):
        torch.ops.genserve.moe_experts_gguf(
            x, ids, weights, experts.gate, experts.up, experts.down, [1, 8, 8], -1
        )
    with pytest.raises(RuntimeError, match="must be contiguous uint8"):
        torch.ops.genserve.moe_experts_gguf(
            x, ids, weights, experts.gate[:, :, :-1].contiguous(), experts.up, experts.down,
            experts.codes, -1,
        )  # fmt: skip


def test_gguf_names_of_moe_tensors() -> None:
    name = gguf_names.hf_tensor_name
    assert name("blk.3.ffn_gate_inp.weight", "qwen3moe") == "model.layers.3.mlp.gate.weight"
    assert name("blk.3.ffn_down_exps.weight", "qwen3moe") == "model.layers.3.mlp.experts.down_proj"
    assert name("blk.0.ffn_up_shexp.weight", "qwen2moe") == (
        "model.layers.0.mlp.shared_expert.up_proj.weight"
    )
    assert name("blk.0.ffn_gate_inp_shexp.weight", "qwen2moe") == (
        "model.layers.0.mlp.shared_expert_gate.weight"
    )
    # gpt-oss (llama.cpp's converter): sinks without .weight, router with a bias, expert
    # biases beside the stacks, the pre-MLP norm as post_attention_norm
    assert name("blk.2.attn_sinks.weight", "gpt-oss") == "model.layers.2.self_attn.sinks"
    assert name("blk.2.ffn_gate_inp.bias", "gpt-oss") == "model.layers.2.mlp.router.bias"
    assert name("blk.2.ffn_up_exps.bias", "gpt-oss") == "model.layers.2.mlp.experts.up_proj_bias"
    assert name("blk.2.ffn_up_exps.weight", "gpt-oss") == "model.layers.2.mlp.experts.up_proj"
    assert name("blk.2.post_attention_norm.weight", "gpt-oss") == (
        "model.layers.2.post_attention_layernorm.weight"
    )
    assert name("blk.2.attn_output.bias", "gpt-oss") == "model.layers.2.self_attn.o_proj.bias"
    assert not gguf_names.is_expert_stack("blk.2.ffn_up_exps.bias", "gpt-oss")
    assert gguf_names.is_expert_stack("blk.1.ffn_gate_exps.weight", "qwen3moe")
    assert not gguf_names.is_expert_stack("blk.1.ffn_gate.weight", "qwen3moe")
    # the stacks are not dense matrices: --quantize gguf's dense plan never sees them
    assert gguf_names.hf_matrix_name("blk.1.ffn_gate_exps.weight", "qwen3moe") is None


@needs_kernels
def test_moe_gguf_loads_experts_as_blocks(tmp_path: Path) -> None:
    """A Q8_0 file: every MoE layer serves its experts from the file's blocks (the float
    stacks are empty), and a forward equals the reference loop on the same blocks."""
    from genserve.model.loader import resolve_model
    from genserve.model.moe import SparseMoeBlock
    from genserve.testing.moe_gguf import write_moe_gguf
    from genserve.testing.tiny_model import default_tokenizer_dir
    from genserve.worker.runner_setup import load_weights
    from tests.utils.moe_models import make_moe_model

    model_dir = make_moe_model(
        tmp_path / "q3", "qwen3_moe", default_tokenizer_dir(), seed=4, mlp_only_layers=[]
    )
    gguf, _ = write_moe_gguf(tmp_path / "q3.gguf", model_dir, "Q8_0", "Q8_0")
    model = _build(resolve_model(str(gguf), cache_dir=tmp_path / "models"), load_weights)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 2
    for block in blocks:
        assert block.quantized_experts is not None
        assert block.quantized_experts.types == ("Q8_0", "Q8_0", "Q8_0")
        assert block.w13.numel() == 0 and block.w2.numel() == 0
        x = torch.randn(5, 64)
        ids, weights = _routing(5)
        torch.testing.assert_close(
            block.quantized_experts.forward(x, ids, weights),
            experts_gguf_torch(x, ids, weights, block.quantized_experts),
            rtol=1e-5,
            atol=1e-5,
        )


def _build(resolved, load_weights):  # type: ignore[no-untyped-def]
    import dataclasses

    from genserve.model.causal_lm import DecoderForCausalLM
    from genserve.model.config import load_model_config
    from genserve.parallel import ParallelContext

    resolved = dataclasses.replace(resolved, quantize="gguf")
    config = load_model_config(resolved.local_dir)
    model = DecoderForCausalLM(config, ParallelContext.single(), torch.float32, torch.device("cpu"))
    load_weights(model, resolved)
    return model


def test_released_mxfp4_blocks_repack_exactly() -> None:
    """gpt-oss's checkpoint MXFP4 (blocks [E, rows, K/32, 16], scales [E, rows, K/32]) as
    GGML MXFP4 rows (model/mxfp4.py): gguf-py's dequantizer on the result gives exactly what
    transformers' ``convert_moe_packed_tensors`` dequantizes from the checkpoint."""
    from gguf import GGMLQuantizationType, dequantize
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from genserve.model.mxfp4 import ggml_blocks

    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 8, 4), generator=gen, dtype=torch.uint8)
    ours = ggml_blocks(blocks, scales)
    assert ours.shape == (3, 8, 4 * 17)
    got = dequantize(ours.numpy(), GGMLQuantizationType.MXFP4).reshape(3, 8, 128)
    # transformers hands the forward [E, in, out]
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert np.array_equal(got, expected.numpy())


@needs_kernels
def test_moe_gguf_speed_times_the_served_layout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bench/moe_gguf_speed.py`` times the experts in the layout the server runs them
    (``QuantizedExperts.serving``: Q8_0 packed in groups of 16 rows on AVX512-VNNI), not the
    file's, and ``--dense`` adds the dense kernels' MLP of equal bytes."""
    from genserve.bench import moe_gguf_speed
    from genserve.testing.moe_gguf import write_moe_gguf
    from genserve.testing.tiny_model import default_tokenizer_dir
    from tests.utils.moe_models import make_moe_model

    model_dir = make_moe_model(
        tmp_path / "q3", "qwen3_moe", default_tokenizer_dir(), seed=4, mlp_only_layers=[]
    )
    gguf, _ = write_moe_gguf(tmp_path / "q3.gguf", model_dir, "Q8_0", "Q8_0")
    layers = moe_gguf_speed._experts(str(gguf), int(int_dot.Isa.AUTO), 1)
    assert len(layers) == 1
    assert layers[0].types == layers[0].serving(int(int_dot.Isa.AUTO)).types
    packs = (
        int_dot.Isa.AVX512_VNNI in int_dot.available_isas() and layers[0].gate.shape[1] % 16 == 0
    )
    assert layers[0].types[0] == (PACKED_Q8_0 if packs else "Q8_0")
    args = [str(gguf), "--calls", "1", "--top-k", "2", "--layers", "1", "--dense", "--small-pages"]
    assert moe_gguf_speed.main(args) == 0
    out = capsys.readouterr().out
    assert f"| 0 | {', '.join(layers[0].types)} |" in out
    assert "| dense MLP (as layer 0) |" in out
