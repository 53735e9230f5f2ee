"""Chat templates: rendering through transformers gives exactly the ids of
``apply_chat_template(..., tokenize=True)`` (no doubled BOS), the flags that override the
template, and the errors a person can act on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from genserve.chat_template import (
    ChatRenderer,
    ChatTemplateError,
    NoChatTemplateError,
    load_template_override,
)
from genserve.testing.tiny_model import default_tokenizer_dir

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi! ¿Qué tal? 東京"},
        {"role": "assistant", "content": "Hello. Fine."},
        {"role": "user", "content": "Count to three."},
    ],
]

# A template that writes BOS itself (as Llama's do): a tokenizer adding it again would
# double it.
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_default_model_renders_like_transformers(
    hf_tokenizer: Any, conversation: list[dict[str, str]]
) -> None:
    renderer = ChatRenderer(hf_tokenizer, "default")
    assert renderer.has_template  # the GGUF's tokenizer.chat_template survived conversion
    rendered = renderer.render(conversation)
    expected = hf_tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(rendered.token_ids) == list(expected)
    assert rendered.text.endswith("<|im_start|>assistant\n")
    assert rendered.text.count("<|im_start|>") == len(conversation) + 1 + (
        conversation[0]["role"] != "system"  # the template adds a default system turn
    )


def test_template_writing_bos_is_not_doubled(hf_tokenizer: Any) -> None:
    renderer = ChatRenderer(hf_tokenizer, "m", BOS_TEMPLATE)
    rendered = renderer.render(CONVERSATIONS[1])
    expected = hf_tokenizer.apply_chat_template(
        CONVERSATIONS[1],
        chat_template=BOS_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert list(rendered.token_ids) == list(expected)
    assert rendered.token_ids[0] == hf_tokenizer.bos_token_id
    assert rendered.token_ids[1] != hf_tokenizer.bos_token_id


def test_continue_final_message(hf_tokenizer: Any) -> None:
    renderer = ChatRenderer(hf_tokenizer, "m")
    conversation = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital is"}]
    rendered = renderer.render(
        conversation, add_generation_prompt=False, continue_final_message=True
    )
    assert rendered.text.endswith("The capital is")
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        renderer.render(conversation, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="assistant"):
        renderer.render(CONVERSATIONS[0], add_generation_prompt=False, continue_final_message=True)


def test_template_errors_become_chat_template_errors(hf_tokenizer: Any) -> None:
    strict = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    renderer = ChatRenderer(hf_tokenizer, "m", strict + BOS_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="user first"):
        renderer.render(CONVERSATIONS[1])


def test_no_template_names_the_flags(hf_tokenizer: Any) -> None:
    bare = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    bare.chat_template = None
    renderer = ChatRenderer(bare, "tiny")
    assert not renderer.has_template
    with pytest.raises(NoChatTemplateError, match="--chat-template"):
        renderer.render(CONVERSATIONS[0])


def test_chat_template_flag_file_inline_or_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(BOS_TEMPLATE)
    assert load_template_override(str(path), None) == BOS_TEMPLATE
    assert load_template_override(BOS_TEMPLATE, None) == BOS_TEMPLATE  # inline, as vLLM
    with pytest.raises(ValueError, match="--chat-template"):
        load_template_override(str(tmp_path / "missing.jinja"), None)
    assert load_template_override(None, None) is None


def test_tokenizer_config_path(tmp_path: Path) -> None:
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": BOS_TEMPLATE}))
    assert load_template_override(None, config) == BOS_TEMPLATE
    named = tmp_path / "named.json"
    named.write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                      {"name": "default", "template": BOS_TEMPLATE}]})
    )  # fmt: skip
    assert load_template_override(None, named) == BOS_TEMPLATE
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    with pytest.raises(ValueError, match="--tokenizer-config-path"):
        load_template_override(None, empty)
    # --chat-template wins over --tokenizer-config-path.
    assert load_template_override("{{ 'x' }}", config) == "{{ 'x' }}"
