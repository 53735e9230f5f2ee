"""A call's prompts: ``inputs`` (text) or ``input_ids`` (token ids), never both, and how
many one call may carry (--max-client-batch-size)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from genserve.server.conversion.errors import ValidationError
from genserve.server.conversion.extras import check_input_ids
from genserve.server.conversion.limits import Limits
from genserve.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Prompt:
    """One input: its text (for ``return_full_text`` and request logs) and, when the caller
    gave token ids or the server rendered a chat, those ids (None: encode ``text``)."""

    text: str
    token_ids: tuple[int, ...] | None = None


def validate_batch_size(num_inputs: int, limits: Limits) -> None:
    if num_inputs == 0:
        raise ValidationError("`inputs` is empty: send at least one prompt")
    if num_inputs > limits.max_client_batch_size:
        raise ValidationError(
            f"{num_inputs} inputs in one request; at most {limits.max_client_batch_size} are "
            "allowed (--max-client-batch-size)"
        )


def prompt_inputs(
    texts: Sequence[str],
    id_lists: Sequence[Sequence[int]],
    tokenizer: Tokenizer,
    vocab_size: int,
) -> list[Prompt]:
    """The prompts of a call given as ``inputs`` (text) or ``input_ids`` (token ids), never
    both.  A token-id prompt's text is its decoding, special tokens included."""
    if texts and id_lists:
        raise ValidationError("give either `inputs` (text) or `input_ids` (token ids), not both")
    if not id_lists:
        return [Prompt(text) for text in texts]
    prompts: list[Prompt] = []
    for ids in id_lists:
        checked = check_input_ids(ids, vocab_size)
        prompts.append(Prompt(tokenizer.decode(checked, skip_special_tokens=False), checked))
    return prompts
