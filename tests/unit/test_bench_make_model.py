"""``genserve-bench --make-model``: real-shape random-weight models load in genserve and in
transformers (tested with the tiny shape; the real ones differ only in dimensions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from genserve.bench.cli import main
from genserve.model.loader import ResolvedModel
from genserve.testing.shape_model import SHAPES, TYPED_SHAPES
from genserve.worker.model_runner import ModelRunner


def test_real_shapes_are_the_published_ones() -> None:
    eight_b = SHAPES["llama-3.1-8b-shape"]
    assert (eight_b["hidden_size"], eight_b["num_hidden_layers"], eight_b["intermediate_size"]) == (
        4096,
        32,
        14336,
    )
    one_b = SHAPES["llama-3.2-1b-shape"]
    assert (one_b["hidden_size"], one_b["num_hidden_layers"], one_b["head_dim"]) == (2048, 16, 64)


def test_make_model_loads_in_genserve_and_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    assert main(["--make-model", "tiny-shape", str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["vocab_size"] == 49152
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("Hello there", return_tensors="pt")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.inference_mode():
        want = hf(ids).logits[0, -1].argmax().item()
    runner = ModelRunner(ResolvedModel(out, str(out)), torch.float32, torch.device("cpu"))
    runner.initialize_kv_cache(8, 16)
    from genserve.step import NewRequestData, SamplingParams, ScheduledChunk, SchedulerOutput

    prompt = tuple(ids[0].tolist())
    new = NewRequestData("a", prompt, len(prompt), 0, SamplingParams())
    result = runner.execute_model(
        SchedulerOutput(0, (ScheduledChunk("a", prompt, 0, (0,), True),), (new,))
    )
    assert result.sampled[0].token_id == want


def test_moe_benchmark_shapes() -> None:
    """docs/models/moe.md's benchmark models: Qwen3-30B-A3B's expert shape at 4 layers and
    the dense model with its active parameters (checked by their configs: making the real
    ones writes ~6 GB), and the CLI knows their names."""
    from transformers import AutoConfig

    moe_type, moe = TYPED_SHAPES["qwen3-30b-a3b-4l-shape"]
    dense_type, dense = TYPED_SHAPES["qwen3-a3b-dense-4l-shape"]
    assert (moe_type, dense_type) == ("qwen3_moe", "qwen3")
    assert moe["num_experts_per_tok"] * moe["moe_intermediate_size"] == dense["intermediate_size"]
    config = AutoConfig.for_model(moe_type, **moe)
    assert (config.num_experts, config.num_experts_per_tok, config.hidden_size) == (128, 8, 2048)
    assert not config.mlp_only_layers and config.num_hidden_layers == 4
    with pytest.raises(SystemExit):  # the shape is known: only the output dir is missing
        main(["--make-model", "qwen3-30b-a3b-4l-shape"])


def test_make_model_rejects_unknown_shapes(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--make-model", "llama-9t-shape", str(tmp_path)])


def test_tokenizer_dir_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU machine lacks the embedded model's package: GENSERVE_TOKENIZER_DIR (a
    directory with its tokenizer files, carried there) stands in for it."""
    from genserve.testing.tiny_model import default_tokenizer_dir

    monkeypatch.setenv("GENSERVE_TOKENIZER_DIR", str(tmp_path))
    assert default_tokenizer_dir() == tmp_path
    monkeypatch.delenv("GENSERVE_TOKENIZER_DIR")
    assert default_tokenizer_dir() != tmp_path
