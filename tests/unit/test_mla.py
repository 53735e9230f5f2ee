"""Multi-head latent attention (model/mla.py, DeepSeek-V3): the native decoder gives
transformers' logits for a whole prompt, for a prompt computed in chunks over the latent
cache (as after a prefix-cache hit), and for decodes (kv_b_proj absorbed into the query and
output); the cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values per token
and layer, equal to transformers' own latent cache; the runner sizes it so; and dropping the
parts a reader could skip (YaRN's mscale² in the softmax scale, DeepSeek's interleaved rope
layout, the query compression's norm) changes the logits, so the parity tests catch it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from genserve.kernels import cpu as cpu_kernels
from genserve.model.attention import SeqSpec, TorchPagedAttention
from genserve.model.causal_lm import DecoderForCausalLM
from genserve.model.config import ModelConfig, UnsupportedModelError, load_model_config
from genserve.model.loader import ResolvedModel
from genserve.model.mla import LatentAttention, latent_cache_shape
from genserve.model.registry import build_model
from genserve.model.weights import SafetensorsWeights
from genserve.parallel import ParallelContext
from genserve.testing.tiny_model import default_tokenizer_dir
from tests.utils.mla_models import MLA_VARIANTS, make_mla_model

NUM_TOKENS = 80
BLOCK = 16
CPU = torch.device("cpu")
replace = dataclasses.replace


@pytest.fixture(scope="module")
def mla_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mla")
    tok = default_tokenizer_dir()
    return {v: make_mla_model(root / v, v, tok, seed=2) for v in MLA_VARIANTS}


def _ids() -> torch.Tensor:
    return torch.randint(3, 40000, (NUM_TOKENS,), generator=torch.Generator().manual_seed(0))


def _model(config: ModelConfig, model_dir: Path, fused: bool) -> DecoderForCausalLM:
    model = build_model(config, ParallelContext.single(), torch.float32, CPU)
    with SafetensorsWeights(model_dir) as weights:
        model.load_weights(weights)
    if fused:
        model.use_fused_cpu_ops()
    return model


def _caches(config: ModelConfig) -> list[torch.Tensor]:
    assert config.mla is not None
    blocks = -(-NUM_TOKENS // BLOCK)
    shape = latent_cache_shape(blocks, BLOCK, config.mla.cache_width)
    return [torch.zeros(shape) for _ in range(config.num_layers)]


def _run(
    model: DecoderForCausalLM,
    caches: list[torch.Tensor],
    ids: torch.Tensor,
    start: int,
    num_decodes: int,
    backend: TorchPagedAttention,
) -> torch.Tensor:
    """Tokens ``ids`` at positions ``start..`` of one sequence (as decodes or as a chunk)."""
    blocks = tuple(range(caches[0].shape[2]))
    n = ids.shape[0]
    meta = backend.build([SeqSpec(1 if num_decodes else n, start, blocks)], num_decodes, BLOCK)
    return model.compute_logits(model(ids, torch.arange(start, start + n), caches, meta))


def _logits_whole(config: ModelConfig, model_dir: Path, fused: bool = False) -> torch.Tensor:
    model = _model(config, model_dir, fused)
    return _run(model, _caches(config), _ids(), 0, 0, TorchPagedAttention(CPU))


def _reference(model_dir: Path) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return hf(_ids()[None]).logits[0].float()


def _kernels() -> bool:
    return cpu_kernels.usable(CPU, torch.float32)


@pytest.mark.parametrize("variant", sorted(MLA_VARIANTS))
@pytest.mark.parametrize("fused", [False, True])
def test_logits_match_transformers(variant: str, fused: bool, mla_dirs: dict[str, Path]) -> None:
    """A whole prompt; then the same tokens as a 50-token prompt, a 10-token chunk reading
    the first 50 from the latent cache, and 20 decodes."""
    if fused and not _kernels():
        pytest.skip("genserve's CPU kernels are not built here")
    model_dir = mla_dirs[variant]
    config = load_model_config(model_dir)
    assert config.mla is not None and config.architecture == "DeepseekV3ForCausalLM"
    with torch.inference_mode():
        want = _reference(model_dir)
        model = _model(config, model_dir, fused)
        backend = TorchPagedAttention(CPU, use_cpu_kernel=fused)
        whole = _run(model, _caches(config), _ids(), 0, 0, backend)
        assert torch.allclose(whole, want, atol=1e-4)
        ids, caches = _ids(), _caches(config)
        parts = [_run(model, caches, ids[:50], 0, 0, backend)]
        parts.append(_run(model, caches, ids[50:60], 50, 0, backend))
        for t in range(60, NUM_TOKENS):
            parts.append(_run(model, caches, ids[t : t + 1], t, 1, backend))
        assert torch.allclose(torch.cat(parts), want, atol=1e-4)


def test_cache_holds_the_latent_rows(mla_dirs: dict[str, Path]) -> None:
    """Per token and layer one row of ``kv_lora_rank + qk_rope_head_dim`` values: the normed
    latent and the rotated rope key, equal to what transformers' own cache holds for
    DeepSeek-V3 (its ``keys`` / ``values`` are the latent and the rope key)."""
    model_dir = mla_dirs["deepseek_v3"]
    config = load_model_config(model_dir)
    assert config.mla is not None
    rank, rope = config.mla.kv_lora_rank, config.mla.qk_rope_head_dim
    with torch.inference_mode():
        model = _model(config, model_dir, fused=False)
        caches = _caches(config)
        _run(model, caches, _ids(), 0, 0, TorchPagedAttention(CPU))
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        hf_cache = DynamicCache(config=hf.config)
        hf(_ids()[None], cache=hf_cache, use_cache=True)
    assert caches[0].shape == (1, 1, 5, BLOCK, rank + rope)
    for layer, cache in enumerate(caches):
        rows = cache.view(-1, rank + rope)[:NUM_TOKENS]
        latent = hf_cache.layers[layer].keys[0, 0]  # [tokens, kv_lora_rank]
        rope_key = hf_cache.layers[layer].values[0, 0]  # [tokens, qk_rope_head_dim]
        assert torch.allclose(rows[:, :rank], latent, atol=1e-5)
        assert torch.allclose(rows[:, rank:], rope_key, atol=1e-5)
        assert not cache.view(-1, rank + rope)[NUM_TOKENS:].any()  # nothing past the tokens


def test_runner_sizes_the_latent_cache(mla_dirs: dict[str, Path]) -> None:
    from genserve.worker.model_runner import ModelRunner

    model_dir = mla_dirs["deepseek_v3_q_proj"]
    runner = ModelRunner(ResolvedModel(model_dir, str(model_dir)), torch.float32, CPU)
    mla = runner.config.mla
    assert mla is not None and mla.cache_width == 32 + 16
    # 4 bytes x (latent 32 + rope 16) x 3 layers per token; full K/V would be
    # 4 heads x (32 key + 24 value) = 224 wide: 4.7x more.
    assert runner.kv_cache_bytes_per_block(BLOCK) == BLOCK * 3 * 4 * 48
    runner.initialize_kv_cache(6, BLOCK)
    assert [tuple(c.shape) for c in runner.kv_caches] == [(1, 1, 6, BLOCK, 48)] * 3


Ablation = Callable[[ModelConfig], ModelConfig]


def _mla(**changes: object) -> Ablation:
    def ablate(c: ModelConfig) -> ModelConfig:
        assert c.mla is not None
        return replace(c, mla=replace(c.mla, **changes))

    return ablate


ABLATIONS: list[tuple[str, str, Ablation]] = [
    ("deepseek_v3", "YaRN mscale² in the softmax scale",
     lambda c: replace(c, attention=replace(c.attention, scale=(16 + 16) ** -0.5))),
    ("deepseek_v3", "interleaved rope pairs", _mla(interleaved_rope=False)),
    ("deepseek_v3", "q_a / kv_a norm epsilon", _mla(norm_eps=0.5)),
]  # fmt: skip


@pytest.mark.parametrize(("variant", "feature", "ablate"), ABLATIONS)
def test_feature_changes_the_reference(
    variant: str, feature: str, ablate: Ablation, mla_dirs: dict[str, Path]
) -> None:
    model_dir = mla_dirs[variant]
    config = load_model_config(model_dir)
    with torch.inference_mode():
        base = _logits_whole(config, model_dir)
        ablated = _logits_whole(ablate(config), model_dir)
    assert (base - ablated).abs().max() > 1e-2, feature


def test_uneven_head_split_is_refused(mla_dirs: dict[str, Path]) -> None:
    config = load_model_config(mla_dirs["deepseek_v3"])  # 4 heads
    with pytest.raises(UnsupportedModelError, match="--num-shard 3"):
        LatentAttention(config, 0, ParallelContext(rank=0, world_size=3), torch.float32, CPU)


def test_quantized_checkpoint_is_not_read_natively() -> None:
    """DeepSeek's released weights are FP8 blocks with scales the native loader does not
    apply: such a config is refused natively (the fallback takes it)."""
    from transformers import DeepseekV3Config

    from genserve.model.families import config_from_hf

    hf = DeepseekV3Config(
        num_hidden_layers=2,
        quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]},
    )
    with pytest.raises(UnsupportedModelError, match="'fp8'"):
        config_from_hf(hf)
