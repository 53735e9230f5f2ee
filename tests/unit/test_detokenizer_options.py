"""The detokenizer's issue #15 options: skip_special_tokens, include_stop_str_in_output, and
the text of a token that ended generation by itself (EOS, a stop token id)."""

from __future__ import annotations

from pathlib import Path

import pytest

from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.tokenizer import Tokenizer

TEXT = "Héllo wörld, naïve café, garçon"
EOS_TEXT = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(Path(default_tokenizer_dir()))


def run(tokenizer: Tokenizer, ids: list[int], **options: object) -> str:
    stop = options.pop("stop", ())
    detok = tokenizer.detokenizer(tokenizer.encode("Prompt:"), stop, **options)  # type: ignore[arg-type]
    text = "".join(detok.add(i) for i in ids)
    return text + detok.flush()


@pytest.mark.parametrize("stop", ["wörld", "ld, na", "é", ", garçon"])
def test_include_stop_str_keeps_the_stop_and_nothing_after(tokenizer: Tokenizer, stop: str) -> None:
    ids = tokenizer.encode(TEXT + " and more", add_special_tokens=False)
    cut = TEXT.index(stop)
    assert run(tokenizer, ids, stop=[stop]) == TEXT[:cut]
    assert run(tokenizer, ids, stop=[stop], include_stop_str=True) == TEXT[: cut + len(stop)]


def test_special_tokens_shown_only_when_not_skipped(tokenizer: Tokenizer) -> None:
    (eos,) = tokenizer.eos_token_ids
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), eos, *tokenizer.encode(" there")]
    assert run(tokenizer, ids) == "Hi there"
    assert run(tokenizer, ids, skip_special_tokens=False) == f"Hi{EOS_TEXT} there"


def test_a_token_that_ends_generation_keeps_its_text_only_when_asked(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("Hello world.", add_special_tokens=False)
    last = ids[-1]  # "." as a stop token id
    for include, expected in ((False, "Hello world"), (True, "Hello world.")):
        detok = tokenizer.detokenizer([], include_stop_str=include)
        text = "".join(detok.add(i) for i in ids[:-1])
        text += detok.add(last, ends_generation=True) + detok.flush()
        assert text == expected
