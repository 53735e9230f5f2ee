"""Start-up messages that name the real cause (issue #30): two GGUF files are named and the
user is asked which; limits lowered to fit the KV cache are logged with the flag that did it;
--max-total-tokens too small to hold a prompt blames that flag, not the KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from genserve.config import load_config
from genserve.limits import LimitsError, derive_limits
from genserve.model.loader import ModelNotFoundError, resolve_model
from genserve.tokenizer import require_tokenizer_files


def test_two_gguf_files_are_named(tmp_path: Path) -> None:
    model = tmp_path / "two"
    model.mkdir()
    for name in ("a.Q4_0.gguf", "b.Q8_0.gguf"):
        (model / name).write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(str(model), cache_dir=tmp_path / "cache")
    message = str(err.value)
    assert "a.Q4_0.gguf" in message and "b.Q8_0.gguf" in message and "which one" in message


def test_a_directory_without_tokenizer_files_names_them(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer: none of tokenizer\.json"):
        require_tokenizer_files(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(FileNotFoundError):
        require_tokenizer_files(tmp_path)  # a BPE vocabulary needs its merges
    (tmp_path / "merges.txt").write_text("")
    require_tokenizer_files(tmp_path)


def test_max_total_tokens_too_small_for_a_prompt() -> None:
    config = load_config(["--max-total-tokens", "1"])
    with pytest.raises(LimitsError) as err:
        derive_limits(config, 4096, memory_num_blocks=8, on_cuda=False)
    assert "--max-total-tokens (1) leaves no room for a prompt" in str(err.value)
    assert "KV cache" not in str(err.value)


@pytest.mark.parametrize(
    ("flags", "cause"),
    [
        (["--max-batch-total-tokens", "10"], "--max-batch-total-tokens=10"),
        ([], "free memory (--cpu-memory-fraction)"),
    ],
)
def test_lowered_limits_name_their_cause(flags: list[str], cause: str) -> None:
    with structlog.testing.capture_logs() as logs:
        limits = derive_limits(load_config(flags), 4096, memory_num_blocks=1, on_cuda=False)
    assert (limits.max_total_tokens, limits.max_input_tokens) == (16, 15)
    assert limits.lowered_by == cause
    (warning,) = [e for e in logs if e["event"] == "limits_lowered"]
    assert warning["log_level"] == "warning" and warning["cause"] == cause


def test_limits_that_fit_are_not_lowered() -> None:
    limits = derive_limits(load_config([]), 4096, memory_num_blocks=10_000, on_cuda=False)
    assert limits.lowered_by is None and limits.max_total_tokens == 4096
