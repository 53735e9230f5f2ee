"""A GGUF Q4_K_M model's decode-only CPU steps run each layer as one ``genserve::decode_layer``
op, its K-quant projections (the fused Q/K/V mixing Q4_K rows with Q6_K ones, gate/up in Q4_K,
down in Q6_K) through ``genserve::kquant_linear`` inside the op, on the float path and on the
integer (Q8_K activations) path: hidden states and the KV cache it writes are bit-identical
to the layer-by-layer step, which calls the same kernel from Python (the down projection adds
into the residual as it stores: the same float32 sum)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from genserve.kernels import cpu as cpu_kernels
from genserve.kernels import int_dot
from genserve.model.kquants import FLOAT_PATH, KQuantWeight
from genserve.testing.tiny_gguf import make_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="CPU kernels did not build")


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Q4_K_M file and its model-cache entry (config and tokenizer)."""
    from genserve.model.loader import resolve_model

    tmp = tmp_path_factory.mktemp("kquant-fused")
    model = make_tiny_gguf(tmp / "tiny-Q4_K_M.gguf", "Q4_K_M", seed=3)
    entry = resolve_model(str(model), cache_dir=tmp / "cache" / "models").local_dir
    return model, entry


@pytest.fixture
def restore_mode() -> Iterator[None]:
    saved = int_dot.mode()
    yield
    int_dot.configure(saved)


def _build(gguf_file: Path, entry: Path, dtype: torch.dtype) -> torch.nn.Module:
    from genserve.model.config import load_model_config
    from genserve.model.gguf_weights import GGUFWeights
    from genserve.model.quantize_model import quantize_model
    from genserve.model.registry import build_model
    from genserve.parallel import ParallelContext

    config = load_model_config(entry)
    model = build_model(config, ParallelContext.single(), dtype, torch.device("cpu"))
    with GGUFWeights(gguf_file, config.num_heads, config.num_kv_heads) as gguf:
        quantize_model(model, "gguf", gguf.quantized_view())
        with torch.inference_mode():
            model.load_weights(gguf)
    model.use_fused_cpu_ops(matvec_rows=32)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["float", "int"])
def test_k_quant_layers_decode_in_one_op_like_the_layer_by_layer_step(
    q4_k_m: tuple[Path, Path], dtype: torch.dtype, path: str, restore_mode: None
) -> None:
    from genserve.model.attention import SeqSpec, TorchPagedAttention

    if path == "int" and not int_dot.available_isas():
        pytest.skip("no integer kernel path on this CPU (no AVX2)")
    int_dot.configure("on" if path == "int" else "off")
    model = _build(*q4_k_m, dtype)
    kquants = [
        m.qpanels for m in model.modules() if isinstance(getattr(m, "qpanels", None), KQuantWeight)
    ]
    assert kquants, "the Q4_K_M file's matrices should stay K-quant super-blocks"
    assert any(len(k.types) > 1 for k in kquants)  # Q/K in Q4_K beside V in Q6_K
    assert all((k.isa == FLOAT_PATH) == (path == "float") for k in kquants)
    assert model._decode_layers_fused, "K-quant layers should take the fused decode layer"

    config = model.config
    backend = TorchPagedAttention(torch.device("cpu"), use_cpu_kernel=True)
    lens, tables = (37, 5, 20), [(4, 2, 6), (9,), (11, 12)]
    decodes = [SeqSpec(1, n, t) for n, t in zip(lens, tables, strict=True)]
    tokens, positions = torch.tensor([7, 100, 3]), torch.tensor(lens)
    with torch.inference_mode():
        shape = backend.kv_cache_shape(16, 16, model.num_local_kv_heads, config.head_dim)
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(config.num_layers)]

        def step(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
            model._decode_layers_fused = fused
            kv = [c.clone() for c in caches]
            hidden = model(tokens, positions, kv, backend.build(decodes, len(decodes), 16))
            return hidden, kv

        (fused_hidden, fused_kv), (plain_hidden, plain_kv) = step(True), step(False)
    assert torch.isfinite(fused_hidden).all()
    assert torch.equal(fused_hidden, plain_hidden)
    assert all(torch.equal(a, b) for a, b in zip(fused_kv, plain_kv, strict=True))
