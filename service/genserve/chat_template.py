"""Chat templates: a conversation → the model's prompt text and token ids.

Rendering is transformers' own (``apply_chat_template``, Jinja in a sandbox), never a
template engine of ours.  Encoding follows ``apply_chat_template(..., tokenize=True)``: the
rendered text is encoded *without* the tokenizer's special tokens, because templates write
BOS themselves where the model wants one (adding it again would double it and change the
output against ``generate()``).

Where the template comes from, first match wins (the flags of SGLang/vLLM and TGI):
``--chat-template`` (a file, or the template text itself), ``--tokenizer-config-path`` (a
``tokenizer_config.json`` whose ``chat_template`` is used), the model's own tokenizer files
(``tokenizer_config.json`` / ``chat_template.jinja``, which is where a GGUF file's
``tokenizer.chat_template`` lands after conversion).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# "developer" is OpenAI's newer name for "system"; it is rendered as "system" (server/chat.py).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (the template refused it, or bad options)."""


class NoChatTemplateError(RuntimeError):
    """The model has no chat template and none was given."""

    def __init__(self, model_id: str) -> None:
        super().__init__(
            f"model {model_id!r} has no chat template: start the server with "
            "--chat-template FILE (a Jinja chat template) or --tokenizer-config-path "
            "(a tokenizer_config.json with a chat_template)"
        )


@dataclass(frozen=True, slots=True)
class RenderedChat:
    text: str
    token_ids: tuple[int, ...]


def load_template_override(
    chat_template: str | None, tokenizer_config_path: Path | None
) -> str | None:
    """The template text the flags ask for, or None to use the model's own.

    ``chat_template`` names a file; a value that is not a file but looks like Jinja
    (``{{`` or ``{%``) is the template itself (as vLLM accepts).  Raises ValueError with a
    message naming the flag when neither holds."""
    if chat_template:
        path = Path(chat_template).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
        if "{{" in chat_template or "{%" in chat_template:
            return chat_template
        raise ValueError(
            f"--chat-template {chat_template!r} is neither a file nor a Jinja template"
        )
    if tokenizer_config_path is not None:
        try:
            config = json.loads(tokenizer_config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--tokenizer-config-path {tokenizer_config_path}: {exc}") from None
        template = _template_from_config(config.get("chat_template"))
        if template is None:
            raise ValueError(
                f"--tokenizer-config-path {tokenizer_config_path} has no chat_template"
            )
        return template
    return None


def _template_from_config(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of ``{"name", "template"}`` (take "default")."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str) and chosen:
            return chosen
    return None


class ChatRenderer:
    """Renders conversations with one template through an HF tokenizer."""

    def __init__(self, hf_tokenizer: Any, model_id: str, template: str | None = None) -> None:
        self._hf = hf_tokenizer
        self.model_id = model_id
        own = getattr(hf_tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates
            own = own.get("default")
        self.template: str | None = template or (own if isinstance(own, str) and own else None)

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> RenderedChat:
        """Raises NoChatTemplateError, or ChatTemplateError for a conversation the template
        (or transformers) refuses.  ``tools`` (OpenAI's shape) go to the template's
        ``tools`` variable."""
        if self.template is None:
            raise NoChatTemplateError(self.model_id)
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "`continue_final_message` continues the last message: set "
                "`add_generation_prompt` to false with it"
            )
        if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ChatTemplateError(
                "`continue_final_message` needs the last message to be an assistant message"
            )
        try:
            text = self._hf.apply_chat_template(
                [dict(m) for m in messages],
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=[dict(t) for t in tools] if tools else None,
                tokenize=False,
            )
        except Exception as exc:  # jinja2 TemplateError, raise_exception(...), ValueError
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
        if not isinstance(text, str):
            raise ChatTemplateError("the chat template did not render to text")
        ids = self._hf(text, add_special_tokens=False)["input_ids"]
        return RenderedChat(text=text, token_ids=tuple(int(i) for i in ids))
