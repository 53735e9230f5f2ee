"""Tool definitions as the server holds them, checked once per request."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class ToolRequestError(ValueError):
    """The request's tools or tool_choice are not usable (INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON Schema of the arguments object

    def template_form(self) -> dict[str, Any]:
        """The OpenAI shape transformers' ``apply_chat_template(tools=...)`` takes."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def tool_spec(index: int, kind: str, name: str, description: str, parameters: str) -> ToolSpec:
    """One ``tools[index]`` entry, checked: type "function", a name, a schema object."""
    if kind not in ("", "function"):
        raise ToolRequestError(f"tools[{index}].type is {kind!r}; only 'function' is supported")
    if not name:
        raise ToolRequestError(f"tools[{index}].function.name is empty")
    schema: Any = {"type": "object"}
    if parameters:
        try:
            schema = json.loads(parameters)
        except ValueError as exc:
            raise ToolRequestError(
                f"tools[{index}].function.parameters is not JSON: {exc}"
            ) from None
        if not isinstance(schema, dict):
            raise ToolRequestError(f"tools[{index}].function.parameters must be a JSON object")
        if not schema:
            schema = {"type": "object"}
    return ToolSpec(name, description, schema)
