"""--reasoning-parser: <think>…</think> split out of replies, whole and streamed in pieces
of every size (a tag split across tokens is held back, never sent as content)."""

from __future__ import annotations

import pytest

from genserve.server.reasoning import reasoning_parser_named

QWEN3 = reasoning_parser_named("qwen3")
R1 = reasoning_parser_named("deepseek_r1")


def streamed(parser_name: str, text: str, step: int) -> tuple[str, str]:
    stream = reasoning_parser_named(parser_name).stream()
    reasoning, content = [], []
    for i in range(0, len(text), step):
        r, c = stream.feed(text[i : i + step])
        reasoning.append(r)
        content.append(c)
    r, c = stream.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_qwen3_reply(step: int) -> None:
    text = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello! How can I help?"
    assert streamed("qwen3", text, step) == (
        "\nThe user greets me. I greet back.\n",
        "Hello! How can I help?",
    )
    assert QWEN3.split(text) == streamed("qwen3", text, step)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_qwen3_without_thinking_is_all_content(step: int) -> None:
    text = "Hello! <think> is a tag I mention."
    assert streamed("qwen3", text, step) == ("", text)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_deepseek_r1_starts_inside_reasoning(step: int) -> None:
    # DeepSeek-R1's template ends the prompt with "<think>\n": the reply starts inside it.
    text = "Okay, 2 + 2 is 4.\n</think>\n\nThe answer is 4."
    assert streamed("deepseek_r1", text, step) == ("Okay, 2 + 2 is 4.\n", "The answer is 4.")
    with_tag = "<think>" + text
    assert streamed("deepseek_r1", with_tag, step) == ("Okay, 2 + 2 is 4.\n", "The answer is 4.")


def test_unfinished_reasoning_stays_reasoning() -> None:
    assert R1.split("thinking and thinking </thi") == ("thinking and thinking </thi", "")
    assert QWEN3.split("<think>cut short") == ("cut short", "")


def test_unknown_parser() -> None:
    with pytest.raises(ValueError, match="--reasoning-parser"):
        reasoning_parser_named("nope")
