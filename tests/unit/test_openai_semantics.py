"""OpenAI semantics the OpenAI routes need (issue #27): frequency_penalty over the output,
fill-in-the-middle prompts, and a chat reply split into reasoning, content and tool calls."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from genserve.server.chat_reply import ChoiceReply, whole_reply
from genserve.server.conversion.fim import FimUnsupportedError, fim_prompts
from genserve.server.reasoning import reasoning_parser_named
from genserve.server.tool_calls import parser_named, plan_tools
from genserve.step import SamplingParams
from genserve.testing.tiny_model import default_tokenizer_dir
from genserve.tokenizer import Tokenizer
from genserve.v1 import generate_pb2 as pb
from genserve.worker.sampler import Sampler, SamplingRow

VOCAB = 100
CPU = torch.device("cpu")


def output_row(prompt: list[int], output: list[int], penalty: float) -> SamplingRow:
    counts = torch.bincount(torch.tensor(prompt + output), minlength=VOCAB).float()
    out_counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=VOCAB).float()
    return SamplingRow(
        SamplingParams(output_frequency_penalty=penalty),
        output_index=len(output),
        num_tokens=len(prompt) + len(output),
        token_counts=counts,
        output_counts=out_counts,
    )


@pytest.mark.parametrize("penalty", [2.0, 0.5, -1.0])
def test_output_frequency_penalty_is_penalty_times_output_count(penalty: float) -> None:
    """OpenAI's documented formula: logit -= count_in_output * frequency_penalty; prompt
    occurrences do not count (TGI's frequency_penalty divides by the length instead)."""
    x = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    prompt, output = [7, 7, 7, 8], [1, 1, 1, 2]
    got = Sampler(CPU)._apply_penalties(x.clone(), [output_row(prompt, output, penalty)])
    expected = x[0].clone()
    expected[1] -= 3 * penalty
    expected[2] -= 1 * penalty
    assert torch.allclose(got[0], expected, atol=1e-6)


def test_openai_frequency_penalty_breaks_a_repetition_tgi_semantics_keeps() -> None:
    """ "Hello, hello, hello": the repeated token 5 leads by 1.0; OpenAI's 2.0 x 3 drops it."""
    x = torch.zeros(1, VOCAB)
    x[0, 5], x[0, 6] = 2.0, 1.0
    out = Sampler(CPU)(x, [output_row([], [5, 5, 5], 2.0)])
    assert out.token_ids == [6]


def fim_tokenizer_dir(tmp: Path) -> Path:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    hf.add_special_tokens(
        {"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]}
    )
    hf.save_pretrained(str(tmp))
    for name in ("config.json", "generation_config.json"):
        if (default_tokenizer_dir() / name).exists():
            shutil.copy(default_tokenizer_dir() / name, tmp / name)
    return tmp


def test_fim_prompt_uses_the_tokenizers_tokens(tmp_path: Path) -> None:
    tok = Tokenizer(fim_tokenizer_dir(tmp_path))
    assert tok.fim_tokens == ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")
    (prompt,) = fim_prompts(tok, ["def add(a, b):\n"], False, "\n    return c\n")
    assert prompt == "<fim_prefix>def add(a, b):\n<fim_suffix>\n    return c\n<fim_middle>"
    ids = tok.encode(prompt, add_special_tokens=False)
    fim_ids = {tok.hf.convert_tokens_to_ids(t) for t in tok.fim_tokens or ()}
    assert fim_ids <= set(ids)  # each marker is one token, not its spelling
    with pytest.raises(FimUnsupportedError, match="text prompt"):
        fim_prompts(tok, [""], True, "x")


def test_fim_refused_without_fim_tokens() -> None:
    tok = Tokenizer(default_tokenizer_dir())  # SmolLM2's tokenizer has none
    assert tok.fim_tokens is None
    with pytest.raises(FimUnsupportedError, match="fill-in-the-middle"):
        fim_prompts(tok, ["a"], False, "b")


def test_reply_with_reasoning_and_tool_call_streams_like_whole() -> None:
    tools = plan_tools(
        [pb.Tool(type="function", function=pb.FunctionDefinition(name="f"))],
        None,
        True,
        parser_named("hermes"),
    )
    reasoning = reasoning_parser_named("qwen3")
    text = (
        "<think>I should call f.</think>\n\nOn it.\n"
        '<tool_call>{"name": "f", "arguments": {"q": 1}}</tool_call>'
    )
    whole = whole_reply(text, tools, reasoning)
    assert whole.reasoning == "I should call f."
    assert whole.content == "On it.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [
        ("f", {"q": 1})
    ]
    assert whole.tool_calls[0].id.startswith("call_")
    reply = ChoiceReply(tools, reasoning)
    pieces = [reply.feed(text[i : i + 2]) for i in range(0, len(text), 2)]
    last = reply.finish()
    assert "".join(p.content for p in pieces) + last.content == whole.content
    assert "".join(p.reasoning for p in pieces) + last.reasoning == whole.reasoning
    assert [c.function.arguments for c in last.tool_calls] == [
        c.function.arguments for c in whole.tool_calls
    ]
