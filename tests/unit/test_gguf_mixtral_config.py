"""``gguf_config.mixtral_from_llama``: a ``llama`` GGUF with ``llama.expert_count`` (how
llama.cpp's converter writes Mixtral) keeps a ``MixtralConfig``; a dense one its own config;
a shared expert (Granite-MoE's layout) is refused; fused gate/up expert stacks are refused
by the serving-path check.  The files hold metadata (and one tensor) only."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import LlamaConfig, MixtralConfig

from genserve.model.gguf_config import mixtral_from_llama


def _gguf(path: Path, **experts: int) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_feed_forward_length(64)
    for key, value in experts.items():
        getattr(writer, f"add_{key}")(value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama() -> LlamaConfig:
    # What transformers reads from such a file: a dense Llama.
    return LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip


def test_llama_with_experts_reads_as_mixtral(tmp_path: Path) -> None:
    gguf = _gguf(tmp_path / "m.gguf", expert_count=8, expert_used_count=2)
    config = mixtral_from_llama(gguf, _llama())
    assert isinstance(config, MixtralConfig)
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok) == (8, 2)
    assert config.intermediate_size == 64  # the expert width: n_ff, as llama.cpp takes it
    assert config.sliding_window is None  # llama.cpp's llama graph has no window
    assert (config.head_dim, config.num_key_value_heads, config.vocab_size) == (16, 2, 300)
    assert config.rope_parameters["rope_theta"] == 1e6
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_expert_width_key_wins(tmp_path: Path) -> None:
    gguf = _gguf(tmp_path / "m.gguf", expert_count=4, expert_used_count=1,
                 expert_feed_forward_length=32)  # fmt: skip
    config = mixtral_from_llama(gguf, _llama())
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 1)
    assert config.intermediate_size == 32


def test_dense_llama_is_kept(tmp_path: Path) -> None:
    dense = _llama()
    assert mixtral_from_llama(_gguf(tmp_path / "d.gguf"), dense) is dense


def test_shared_expert_is_refused(tmp_path: Path) -> None:
    gguf = _gguf(tmp_path / "g.gguf", expert_count=8, expert_used_count=2,
                 expert_shared_feed_forward_length=64)  # fmt: skip
    with pytest.raises(ValueError, match="shared expert"):
        mixtral_from_llama(gguf, _llama())


def test_fused_gate_up_stacks_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file whose experts are ``ffn_gate_up_exps`` (the converter's --fuse-gate-up-exps)
    is refused natively with the reason, not loaded without its experts."""
    import numpy as np
    from gguf import GGUFWriter

    from genserve.model import loader, serving_path
    from genserve.model.config import UnsupportedModelError

    path = tmp_path / "fused.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_expert_count(2)
    writer.add_tensor("blk.0.ffn_gate_up_exps.weight", np.zeros((2, 8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(loader, "transformers_weights_kwargs", lambda _: {"gguf_file": str(path)})
    mixtral = type("Config", (), {"moe": object(), "architecture": "MixtralForCausalLM"})()
    with pytest.raises(UnsupportedModelError, match="ffn_gate_up_exps"):
        serving_path._check_native_weights(mixtral, tmp_path)
