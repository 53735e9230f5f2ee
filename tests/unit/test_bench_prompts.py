"""Prompt sets: determinism, length distribution, exact token lengths, prefix scenario."""

from __future__ import annotations

import random

import pytest

from genserve.bench.prompts import draw_lengths, fit_text, make_prefix_scenario, make_prompts


def bytes_over_three(text: str) -> int:
    """A real, if crude, token counter: about one token per three UTF-8 bytes, so most words
    count as two tokens or more (unlike the one-token-per-word fallback)."""
    return max(1, len(text.encode()) // 3)


def test_same_arguments_same_prompts() -> None:
    first = make_prompts(20, 40, 128, seed=7)
    second = make_prompts(20, 40, 128, seed=7)
    assert first == second
    assert make_prompts(20, 40, 128, seed=8) != first


def test_first_prompts_do_not_depend_on_the_set_size() -> None:
    assert make_prompts(5, 40, 16, seed=3) == make_prompts(50, 40, 16, seed=3)[:5]


def test_lengths_follow_the_distribution_and_bounds() -> None:
    prompts = make_prompts(400, 40, 128, seed=0)
    lengths = [p.num_target_tokens for p in prompts]
    assert 37 <= sum(lengths) / len(lengths) <= 43
    assert min(lengths) >= 8 and max(lengths) <= 160
    assert len(set(lengths)) > 10  # a distribution, not a constant
    assert all(p.max_new_tokens == 128 for p in prompts)
    assert [p.prompt_id for p in prompts] == list(range(400))
    # Without a counter the word count is the length.
    assert all(len(p.text.split()) == p.num_target_tokens for p in prompts)


def test_counter_makes_lengths_exact_or_closest_shorter() -> None:
    prompts = make_prompts(30, 40, 8, seed=1, count_tokens=bytes_over_three)
    for prompt in prompts:
        num = bytes_over_three(prompt.text)
        assert num <= prompt.num_target_tokens
        # One more word would overshoot; a shortfall is at most a word's worth of tokens.
        assert prompt.num_target_tokens - num <= 4
    exact = sum(bytes_over_three(p.text) == p.num_target_tokens for p in prompts)
    assert exact >= len(prompts) // 2


def test_fit_text_keeps_the_head() -> None:
    text = fit_text("Session abc. Start:", random.Random(0), 3, bytes_over_three)
    assert text.startswith("Session abc. Start:")


def test_draw_lengths_edges() -> None:
    rng = random.Random(0)
    assert draw_lengths(rng, 3, 10, 0) == [10, 10, 10]
    assert all(4 <= n <= 12 for n in draw_lengths(rng, 200, 10, 50, minimum=4, maximum=12))
    with pytest.raises(ValueError):
        draw_lengths(rng, 1, 2, 1, minimum=4)


def test_prefix_scenario_shares_exactly_one_system_prompt() -> None:
    scenario = make_prefix_scenario(4, 8, seed=0, salt="s1", system_prompt_tokens=200)
    again = make_prefix_scenario(4, 8, seed=0, salt="s1", system_prompt_tokens=200)
    assert scenario == again
    warm_systems = {p.text.split("\n\n")[0] for p in (scenario.warm_primer, *scenario.warm_prompts)}
    assert len(warm_systems) == 1
    (shared,) = warm_systems
    assert len(shared.split()) == 200 and "s1" in shared
    assert len({p.text for p in scenario.warm_prompts}) == 4  # distinct questions
    cold_systems = [p.text.split("\n\n")[0] for p in scenario.cold_prompts]
    assert len(set(cold_systems)) == 4
    # Cold prompts differ from each other and from the warm one within the first words,
    # i.e. in the first KV block.
    assert len({" ".join(s.split()[:2]) for s in [*cold_systems, shared]}) == 5
    assert make_prefix_scenario(4, 8, seed=0, salt="s2", system_prompt_tokens=200) != scenario
