"""Seeded, deterministic prompt sets for the benchmark.

Two workloads:

* :func:`make_prompts` — independent prompts whose lengths (in tokens) are drawn from a clipped
  normal distribution, each asking for the same fixed number of new tokens.
* :func:`make_prefix_scenario` — requests sharing one long (≈1000-token) system prompt, used
  to compare time-to-first-token with the prefix cache cold and warm.

Texts are built from a fixed list of common English words (each one token, or close to it, in
the usual BPE vocabularies).  When a ``count_tokens`` function is given (a tokenizer of the
served model), each text is trimmed or extended word by word until it has exactly the drawn
number of tokens; without one the word count stands in for the token count.  Either way the
same arguments always give the same texts; the benchmark records the server's own
``input_length`` per request, so what was actually measured is never an assumption.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

TokenCounter = Callable[[str], int]
"""Number of tokens the served model's tokenizer gives a text (as generation would)."""

# Common words that are single tokens in GPT-2-style byte-level BPE vocabularies (SmolLM2,
# Llama 3, GPT-2) when preceded by a space, so word count ≈ token count without a tokenizer.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from his her they this which have were
    had not are but one all been their has when who will more no if out so said what up its
    about into than them can only other new some could time these two may then do first any my
    now such like our over man me even most made after also did many before must through back
    years where much your way well down should because each just those people how too little
    state good very make world still own see men work long get here between both life being
    under never day same another know while last might us great old year off come since
    against go came right used take three small large water house city story river king
    garden market village letter window morning evening summer winter mountain forest road
    ship bridge school music doctor teacher friend mother father brother sister child family
    dinner bread apple horse field stone light night fire wind rain snow island castle tower
    """.split()  # noqa: SIM905 (a word list reads better as text)
)

STORY_LEADS: tuple[str, ...] = (
    "Here is a long story about",
    "Write a detailed report on",
    "Let me tell you everything about",
    "This is the history of",
    "A long letter describing",
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One benchmark request: ``text`` should tokenize to ``num_target_tokens`` tokens."""

    prompt_id: int
    text: str
    num_target_tokens: int
    max_new_tokens: int
    # 0: greedy.  Above 0: sampled at this temperature, seeded with ``prompt_id``.
    temperature: float = 0.0
    # Structured output: a JSON schema the output must follow ("" : unconstrained).
    json_schema: str = ""
    adapter_id: str = ""  # LoRA adapter (the adapters scenario); "": the base model


@dataclass(frozen=True, slots=True)
class PrefixScenario:
    """Requests for measuring prefix-cache reuse.

    ``cold_prompts`` each start with their own system prompt (distinct from the first block
    on), so none can reuse another's KV.  ``warm_primer`` fills the cache with the shared
    system prompt; ``warm_prompts`` repeat it verbatim followed by distinct questions.  The
    ``salt`` is part of every system prompt so that a server still holding blocks from an
    earlier run cannot turn a "cold" request warm.
    """

    system_prompt_tokens: int
    cold_prompts: tuple[Prompt, ...]
    warm_primer: Prompt
    warm_prompts: tuple[Prompt, ...]
    salt: str


def draw_lengths(
    rng: random.Random, num: int, mean: float, std: float, minimum: int = 4, maximum: int = 0
) -> list[int]:
    """``num`` integer lengths from N(mean, std), rounded and clipped to
    ``[minimum, maximum]`` (``maximum == 0``: no upper bound).  ``std == 0`` gives ``mean``."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    if mean < minimum:
        raise ValueError(f"mean length {mean} is below the minimum length {minimum}")
    upper = maximum if maximum > 0 else None
    lengths = []
    for _ in range(num):
        value = round(rng.gauss(mean, std)) if std > 0 else round(mean)
        value = max(minimum, value)
        if upper is not None:
            value = min(upper, value)
        lengths.append(value)
    return lengths


def _words(rng: random.Random, num: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(num)]


def fit_text(
    head: str, rng: random.Random, num_tokens: int, count_tokens: TokenCounter | None
) -> str:
    """``head`` followed by random words, with exactly ``num_tokens`` tokens when a counter
    is given (or ``num_tokens`` words in total, head included, without one).

    With a counter, words are added or dropped one at a time; a word is a token or two, so
    if the target cannot be hit exactly (one word overshoots by two) the closest shorter text
    is returned.  ``head`` is never cut.
    """
    head_words = head.split()
    if count_tokens is None:
        return " ".join(head_words + _words(rng, max(0, num_tokens - len(head_words))))
    words = head_words + _words(rng, max(0, num_tokens - len(head_words)))
    # Bounded: each pass changes the word count by one in a single direction.
    for _ in range(2 * num_tokens + 8):
        num = count_tokens(" ".join(words))
        if num > num_tokens and len(words) > len(head_words):
            words.pop()
        elif num < num_tokens:
            candidate = [*words, rng.choice(WORDS)]
            if count_tokens(" ".join(candidate)) > num_tokens:
                break
            words = candidate
        else:
            break
    return " ".join(words)


def make_prompts(
    num_prompts: int,
    prompt_len_mean: float,
    max_new_tokens: int,
    seed: int,
    prompt_len_std: float | None = None,
    count_tokens: TokenCounter | None = None,
) -> list[Prompt]:
    """The seeded prompt set: lengths ~ N(mean, std) clipped to ``[8, 4 * mean]``
    (``std`` defaults to a quarter of the mean), every prompt asking for ``max_new_tokens``.
    Prompt ``i`` depends only on ``(seed, i)`` and the arguments, not on ``num_prompts``.

    Each text opens with a request for a long piece of writing followed by random words: the
    opening makes an early end-of-sequence token less likely, so outputs tend to run to the
    full ``max_new_tokens``.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    std = prompt_len_mean / 4 if prompt_len_std is None else prompt_len_std
    prompts = []
    for prompt_id in range(num_prompts):
        # One generator per prompt: the first k prompts do not depend on how many are made,
        # so runs of different sizes share their prompts.
        rng = random.Random(f"{seed}:{prompt_id}")
        (length,) = draw_lengths(
            rng, 1, prompt_len_mean, std, minimum=8, maximum=int(4 * prompt_len_mean)
        )
        text = fit_text(rng.choice(STORY_LEADS), rng, length, count_tokens)
        prompts.append(Prompt(prompt_id, text, length, max_new_tokens))
    return prompts


def make_prefix_scenario(
    num_requests: int,
    max_new_tokens: int,
    seed: int,
    salt: str,
    system_prompt_tokens: int = 1000,
    question_tokens: int = 16,
    count_tokens: TokenCounter | None = None,
) -> PrefixScenario:
    """``num_requests`` cold and ``num_requests`` warm requests whose prompts are a
    ``system_prompt_tokens``-token system prompt followed by a ``question_tokens``-token
    question.  The same ``(seed, salt)`` always gives the same scenario."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)

    def system_prompt(tag: str) -> str:
        # The distinguishing tag comes first so two system prompts differ in their first block.
        head = f"Session {salt}-{tag}. You are a helpful assistant. Background notes:"
        return fit_text(head, rng, system_prompt_tokens, count_tokens)

    def with_question(system: str, prompt_id: int) -> Prompt:
        question = fit_text("Question: tell me a long story about", rng, question_tokens, None)
        text = f"{system}\n\n{question}"
        num = count_tokens(text) if count_tokens is not None else len(text.split())
        return Prompt(prompt_id, text, num, max_new_tokens)

    cold = tuple(with_question(system_prompt(f"cold{i}"), i) for i in range(num_requests))
    shared = system_prompt("warm")
    primer = with_question(shared, num_requests)
    warm = tuple(with_question(shared, num_requests + 1 + i) for i in range(num_requests))
    return PrefixScenario(system_prompt_tokens, cold, primer, warm, salt)
