"""What a stream reports of a token: its id, its text, its logprob and whether it is special.

The engine turns the runner's token ids - a sampled token, its top alternatives, the prompt's
tokens when prompt logprobs were asked for - into :class:`~genserve.engine.outputs.TokenInfo`
here, so every output renders a token's text and its ``special`` flag the same way."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from genserve.engine.outputs import TokenInfo
from genserve.step import TokenLogprob
from genserve.tokenizer import Tokenizer


def token_info(
    tokenizer: Tokenizer, token_id: int, logprob: float | None, text: str | None = None
) -> TokenInfo:
    """``token_id`` as a stream reports it; ``text`` defaults to the token's own text (a
    sampled token passes what the incremental detokenizer released for it instead)."""
    return TokenInfo(
        token_id=token_id,
        text=tokenizer.token_text(token_id) if text is None else text,
        logprob=logprob,
        special=token_id in tokenizer.special_ids,
    )


def top_infos(tokenizer: Tokenizer, top: Iterable[TokenLogprob]) -> tuple[TokenInfo, ...]:
    """The top alternatives at one position, most likely first (as the runner sent them)."""
    if not top:  # most tokens: no alternatives asked for
        return ()
    return tuple(token_info(tokenizer, t.token_id, t.logprob) for t in top)


def prefill_infos(
    tokenizer: Tokenizer,
    prompt_token_ids: Sequence[int],
    logprobs: Mapping[int, float],
    top: Mapping[int, tuple[TokenLogprob, ...]],
) -> tuple[tuple[TokenInfo, ...], tuple[tuple[TokenInfo, ...], ...]]:
    """The prompt's tokens with their logprobs by position (None where there is none, as at
    position 0), and - when any alternatives were recorded - each position's alternatives
    (empty where none were)."""
    prefill = tuple(
        token_info(tokenizer, tid, logprobs.get(pos)) for pos, tid in enumerate(prompt_token_ids)
    )
    if not top:
        return prefill, ()
    return prefill, tuple(top_infos(tokenizer, top.get(pos, ())) for pos in range(len(prefill)))
