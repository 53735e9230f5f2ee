"""Tokenization and exact incremental detokenization (multi-byte UTF-8, stop strings)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer
from tokenizers.decoders import DecodeStream

# Tokens of prompt context given to a new decode stream: enough for any merge or
# byte sequence to settle, so the first generated piece decodes as it would mid-text.
_CONTEXT_TOKENS = 8


@dataclass(frozen=True, slots=True)
class TokenSpan:
    token_id: int
    text: str
    start: int  # character offsets into the input text, [start, stop)
    stop: int


# Files any of which a tokenizer can be built from (a fast tokenizers file, a SentencePiece or
# WordPiece vocabulary, a byte-level BPE pair, a tiktoken file).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.txt")
_TOKENIZER_PAIRS = (("vocab.json", "merges.txt"),)


def require_tokenizer_files(model_dir: Path) -> None:
    """FileNotFoundError naming what is missing when ``model_dir`` holds no tokenizer: checked
    before any weight is read, so a directory without one fails in a second, not after the
    model has loaded (transformers' own message then blames a missing sentencepiece)."""
    if any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        return
    if any(all((model_dir / n).is_file() for n in pair) for pair in _TOKENIZER_PAIRS):
        return
    if any(model_dir.glob("*.tiktoken")):
        return
    wanted = ", ".join([*_TOKENIZER_FILES, *(" + ".join(p) for p in _TOKENIZER_PAIRS)])
    raise FileNotFoundError(
        f"{model_dir} has no tokenizer: none of {wanted} (or a *.tiktoken file) is there. "
        "Copy the model's tokenizer files next to its weights (tokenizer.save_pretrained)."
    )


class Tokenizer:
    """The model's fast tokenizer plus what generation needs from it (EOS ids, special ids)."""

    def __init__(
        self, model_dir: Path, trust_remote_code: bool = False, hf_class: type | None = None
    ) -> None:
        """``hf_class``: the transformers class ``AutoTokenizer`` picked for ``model_dir`` at
        an earlier start (``model/derived_memo.py``), built here as ``AutoTokenizer`` builds
        it, without loading the model's config class first (~1.1 s of imports); None: ask
        ``AutoTokenizer``."""
        require_tokenizer_files(model_dir)
        if hf_class is None:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        else:  # AutoTokenizer's own call once it has chosen (a local directory: no revision)
            hf = hf_class.from_pretrained(str(model_dir), _from_auto=True, revision=None)  # type: ignore[attr-defined]
        backend = getattr(hf, "backend_tokenizer", None)
        if not isinstance(backend, FastTokenizer):
            raise ValueError(f"{model_dir}: genserve needs a fast (tokenizers) tokenizer")
        self._hf: Any = hf
        self._tok: FastTokenizer = backend
        self.special_ids: frozenset[int] = frozenset(int(i) for i in hf.all_special_ids)
        self.eos_token_ids: frozenset[int] = _eos_ids(model_dir, hf.eos_token_id)
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def fim_tokens(self) -> tuple[str, str, str] | None:
        """The (prefix, suffix, middle) fill-in-the-middle tokens, when the vocabulary has a
        set: StarCoder's / SmolLM's ``<fim_prefix>`` or Qwen-Coder's ``<|fim_prefix|>``."""
        # Six lookups, not the vocabulary as a dict (a 128k-entry dict built at every start).
        for left, right in (("<", ">"), ("<|", "|>")):
            names = tuple(f"{left}fim_{part}{right}" for part in ("prefix", "suffix", "middle"))
            if all(self._tok.token_to_id(n) is not None for n in names):
                return (names[0], names[1], names[2])
        return None

    @property
    def hf(self) -> Any:
        """The transformers tokenizer: its chat-template machinery renders conversations and
        xgrammar reads the vocabulary from it."""
        return self._hf

    @property
    def backend(self) -> FastTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[TokenSpan]:
        enc = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return [
            TokenSpan(token_id=i, text=text[start:stop], start=start, stop=stop)
            for i, (start, stop) in zip(enc.ids, enc.offsets, strict=True)
        ]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """Text of one token on its own (for prompt tokens and top alternatives)."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))

    def detokenizer(
        self,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        *,
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self._tok,
            prompt_token_ids,
            stop,
            skip_special_tokens=skip_special_tokens,
            include_stop_str=include_stop_str,
        )


def _eos_ids(model_dir: Path, tokenizer_eos: int | None) -> frozenset[int]:
    ids: set[int] = set()
    if tokenizer_eos is not None:
        ids.add(int(tokenizer_eos))
    # generation_config.json may list several (Llama 3 chat models end turns with <|eot_id|>).
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces whose concatenation is exactly the final
    text.  A piece is released only once it is final: bytes of an unfinished UTF-8 character
    wait for the next token, and text that could be the start of a stop string waits until it
    is clearly not one (so a stop string spanning tokens is cut cleanly, and never streamed).

    ``include_stop_str`` (vLLM's include_stop_str_in_output) keeps the stop string, and the
    text of a token that ended generation by itself (EOS, a stop token id), as vLLM does;
    without it both are left out."""

    def __init__(
        self,
        tokenizer: FastTokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str],
        *,
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self._tok = tokenizer
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str
        self._pending = ""
        self.stopped_by: str | None = None

    def add(self, token_id: int, *, ends_generation: bool = False) -> str:
        """Feed one generated token; returns the text that became final (may be empty).
        After a stop string appears, ``stopped_by`` is set and the text up to it is returned
        (and the stop string too with ``include_stop_str``).  ``ends_generation``: this token
        itself ended generation (EOS or a stop token id); its text is dropped unless
        ``include_stop_str``."""
        if self.stopped_by is not None or (ends_generation and not self._include_stop):
            return ""
        piece = self._stream.step(self._tok, token_id)
        if not self._stop:  # nothing is ever held back: no text search, no copy
            return piece or ""
        if piece:
            self._pending += piece
        first: tuple[int, str] | None = None
        for s in self._stop:
            at = self._pending.find(s)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, s)
        if first is not None:
            released = self._pending[: first[0] + (len(first[1]) if self._include_stop else 0)]
            self._pending = ""
            self.stopped_by = first[1]
            return released
        keep = self._longest_stop_prefix_suffix()
        cut = len(self._pending) - keep
        released, self._pending = self._pending[:cut], self._pending[cut:]
        return released

    def flush(self) -> str:
        """At the end of generation: the text held back because it might have begun a stop."""
        released, self._pending = self._pending, ""
        return released

    def _longest_stop_prefix_suffix(self) -> int:
        pending = self._pending
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(pending)), best, -1):
                if pending.endswith(s[:n]):
                    best = n
                    break
        return best
