"""Incremental detokenization: exact for multi-byte UTF-8, stop strings cut cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(Path(default_tokenizer_dir()))


TEXTS = [
    "Hello world",
    "Héllo wörld, naïve café, garçon",
    "東京は日本の首都です。数据 中文",
    "emoji 🎉🚀👩‍👩‍👧 done",
]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_concatenate_to_the_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer(tokenizer.encode("Prompt:"))
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("stop", ["wörld", "ld, na", "é", ", garçon"])
def test_stop_string_spanning_tokens_is_cut_and_never_released(
    tokenizer: Tokenizer, stop: str
) -> None:
    text = TEXTS[1]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer([], stop=[stop])
    released = ""
    for i in ids:
        released += detok.add(i)
        assert stop not in released
        if detok.stopped_by is not None:
            break
    assert detok.stopped_by == stop
    assert released == text[: text.index(stop)]


def test_text_that_only_looks_like_a_stop_start_is_released(tokenizer: Tokenizer) -> None:
    text = "abc abd abe"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer([], stop=["abx"])
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    assert out == text and detok.stopped_by is None


def test_special_tokens_and_eos(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids
    eos = next(iter(tokenizer.eos_token_ids))
    assert eos in tokenizer.special_ids
    detok = tokenizer.detokenizer([])
    assert detok.add(eos) == ""  # special tokens add no text
