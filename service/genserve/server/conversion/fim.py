"""Fill in the middle (OpenAI ``suffix``): a prompt and a suffix → one prompt in the
prefix-suffix-middle order code models are trained on, with the tokenizer's own FIM
tokens.  A model without them cannot do it, and the request is refused rather than
answered as if there were no suffix."""

from __future__ import annotations

from collections.abc import Sequence

from genserve.tokenizer import Tokenizer


class FimUnsupportedError(ValueError):
    """INVALID_ARGUMENT: no FIM tokens, or a token-id prompt (which cannot be wrapped)."""


def fim_prompts(
    tokenizer: Tokenizer,
    texts: Sequence[str],
    has_token_ids: bool,
    suffix: str,
) -> list[str]:
    """``texts`` as FIM prompts ending where the middle is to be generated."""
    tokens = tokenizer.fim_tokens
    if tokens is None:
        raise FimUnsupportedError(
            "`suffix` needs a model whose tokenizer has fill-in-the-middle tokens "
            "(<fim_prefix>, <fim_suffix>, <fim_middle>); this model's has none"
        )
    if has_token_ids:
        raise FimUnsupportedError("`suffix` needs a text prompt, not token ids")
    prefix, suffix_token, middle = tokens
    return [f"{prefix}{text}{suffix_token}{suffix}{middle}" for text in texts]
