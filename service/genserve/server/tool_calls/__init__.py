"""Tool calling in Chat: formats (one parser per format behind :class:`ToolCallParser`),
the choice of format, constrained calls, tools in the prompt, and reading replies."""

from genserve.server.tool_calls.base import ParsedCall, ParsedReply, ToolCallParser, new_call_id
from genserve.server.tool_calls.plan import ToolPlan, ToolReply, plan_tools
from genserve.server.tool_calls.registry import PARSERS, choose_parser, parser_named
from genserve.server.tool_calls.tools import ToolRequestError, ToolSpec

__all__ = [
    "PARSERS",
    "ParsedCall",
    "ParsedReply",
    "ToolCallParser",
    "ToolPlan",
    "ToolReply",
    "ToolRequestError",
    "ToolSpec",
    "choose_parser",
    "new_call_id",
    "parser_named",
    "plan_tools",
]
