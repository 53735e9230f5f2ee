"""``model/gguf_index.py`` reads the same tensors and scalar metadata as gguf-py's reader,
without its per-element parse of metadata arrays, and refuses what is not a GGUF file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from genserve.model.gguf_index import GGUFIndex
from genserve.model.loader import default_gguf_path
from genserve.testing.tiny_gguf import make_tiny_gguf


@pytest.mark.parametrize("preset", ["F16", "Q4_K_M"])
def test_index_matches_gguf_py(tmp_path: Path, preset: str) -> None:
    _same_as_gguf_py(make_tiny_gguf(tmp_path / f"m.{preset}.gguf", preset))


def test_index_of_the_embedded_model_matches_gguf_py() -> None:
    # 272 Q4_1/F32 tensors and a 49,152-token vocabulary with its merges (string arrays).
    _same_as_gguf_py(default_gguf_path())


def _same_as_gguf_py(path: Path) -> None:
    ours, theirs = GGUFIndex(path), GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert (a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.tensor_type,
            b.n_elements,
            b.n_bytes,
            b.data_offset,
        )
        assert list(a.shape) == list(b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)
    scalars = {k: f.contents() for k, f in theirs.fields.items() if len(f.types) == 1}
    kept = {k: f.contents() for k, f in ours.fields.items()}
    assert kept == {k: v for k, v in scalars.items() if not k.startswith("GGUF.")}
    assert "tokenizer.ggml.tokens" not in kept  # arrays are skipped, not parsed


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFIndex(bad)
    good = default_gguf_path().read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good[:4096])  # the header stops inside the vocabulary
    with pytest.raises(ValueError, match="truncated"):
        GGUFIndex(cut)
