"""The fast GGUF metadata reader gives transformers' config reader what gguf-py's does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from genserve.model.gguf_metadata_reader import (
    GGUFMetadataReader,
    fast_config_reader,
    open_reader,
)
from genserve.testing.tiny_gguf import make_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf", "Q8_0")


def test_fields_equal_gguf_py(tiny_gguf: Path) -> None:
    from gguf import GGUFReader

    slow, fast = GGUFReader(tiny_gguf), GGUFMetadataReader(tiny_gguf)
    assert list(fast.fields) == list(slow.fields)
    for key, field in slow.fields.items():
        mine = fast.fields[key]
        assert [int(t) for t in field.types] == mine.types, key
        assert len(field.data) == len(mine.data), key
        assert mine.contents() == field.contents(), key
    assert [t.name for t in fast.tensors] == [t.name for t in slow.tensors]


def test_transformers_config_and_tokenizer_identical(tiny_gguf: Path) -> None:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    slow = load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
    with fast_config_reader():
        fast = load_gguf_checkpoint(str(tiny_gguf), return_tensors=False)
    assert json.dumps(fast, sort_keys=True, default=str) == json.dumps(
        slow, sort_keys=True, default=str
    )
    import gguf

    assert gguf.GGUFReader is not open_reader  # the swap is undone


def test_not_gguf_and_truncated(tmp_path: Path, tiny_gguf: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF"):
        GGUFMetadataReader(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:5000])
    with pytest.raises(ValueError, match="truncated"):
        GGUFMetadataReader(cut)
