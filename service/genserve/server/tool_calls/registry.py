"""Which tool-call format a server parses replies with: ``--tool-call-parser`` (SGLang's and
vLLM's flag and names), else the one the chat template writes, else Hermes, which is then
also the format the server teaches the model in the prompt (``prompt.py``)."""

from __future__ import annotations

from genserve.server.tool_calls.base import ToolCallParser
from genserve.server.tool_calls.hermes import HermesParser
from genserve.server.tool_calls.llama3 import Llama3JsonParser
from genserve.server.tool_calls.mistral import MistralParser

_HERMES = HermesParser()
_LLAMA3 = Llama3JsonParser()
_MISTRAL = MistralParser()

# Names SGLang / vLLM users pass, mapped to the formats (Qwen 2.5 and 3 write Hermes').
PARSERS: dict[str, ToolCallParser] = {
    "hermes": _HERMES,
    "qwen": _HERMES,
    "qwen25": _HERMES,
    "qwen3": _HERMES,
    "llama3": _LLAMA3,
    "llama3_json": _LLAMA3,
    "mistral": _MISTRAL,
}


def parser_named(name: str) -> ToolCallParser:
    """The parser for a ``--tool-call-parser`` value; ValueError naming the choices."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(
            f"--tool-call-parser {name!r} is not known; choose one of {', '.join(sorted(PARSERS))}"
        ) from None


def parser_for_template(template: str | None) -> ToolCallParser | None:
    """The format a chat template renders tool calls in, when it renders any."""
    if not template:
        return None
    if "[TOOL_CALLS]" in template:
        return _MISTRAL
    if "<tool_call>" in template:
        return _HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return _LLAMA3
    return None


def choose_parser(flag: str | None, template: str | None) -> ToolCallParser:
    """The flag's parser, else the template's, else Hermes."""
    if flag:
        return parser_named(flag)
    return parser_for_template(template) or _HERMES
