"""MkDocs hook: the launcher's flag table, rendered from genserve's own argparse parser.

``docs/launcher/flags.md`` holds the marker ``<!-- genserve:flags -->``; ``on_page_markdown``
replaces it with a Markdown table built from ``genserve.config.build_parser()`` at build time, so
the page lists exactly the flags, environment variables, defaults and help texts that
``genserve --help`` prints and cannot drift from the code.  Building the parser imports only the
standard library (``genserve.config``), not torch.

The parser is the contract read here: each option's ``option_strings``, ``choices``, its action
kind (a switch or a value) and the ``[env: ...]`` / ``[default: ...]`` suffixes that
``build_parser`` appends to every help text.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- genserve:flags -->"

_ENV = re.compile(r"\s*\[env: ([^\]]*)\]")
_DEFAULT = re.compile(r"\s*\[default: ([^\]]*)\]")
# Characters that would turn help text into table cells, emphasis or HTML.
_ESCAPES = str.maketrans({"|": r"\|", "*": r"\*", "_": r"\_", "<": "&lt;"})


def load_parser() -> argparse.ArgumentParser:
    """genserve's launcher parser, from this checkout's ``service/`` (not an installed copy)."""
    service = str(ROOT / "service")
    if service not in sys.path:
        sys.path.insert(0, service)
    from genserve.config import build_parser

    return build_parser()


def _cell(text: str) -> str:
    return " ".join(text.split()).translate(_ESCAPES)


def _row(action: argparse.Action) -> str:
    help_text = action.help or ""
    env = _ENV.search(help_text)
    default = _DEFAULT.search(help_text)
    meaning = _DEFAULT.sub("", _ENV.sub("", help_text)).strip()
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    envs = ", ".join(f"`{name.strip()}`" for name in env.group(1).split(",")) if env else ""
    if isinstance(action, argparse._StoreTrueAction):
        shown_default = "off"
    elif isinstance(action, argparse._VersionAction):
        shown_default = ""
        meaning = meaning or "Print the version and exit."
    elif default:
        shown_default = f"`{default.group(1)}`"
    else:
        shown_default = "see meaning" if "default" in meaning.lower() else "unset"
    if action.choices:
        meaning += " One of: " + ", ".join(f"`{c}`" for c in action.choices) + "."
    return f"| {names} | {envs} | {shown_default} | {_cell(meaning)} |"


def render_flags(parser: argparse.ArgumentParser) -> str:
    """A Markdown table with one row per option of ``parser`` (``--help`` excluded)."""
    lines = ["| flag | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        lines.append(_row(action))
    return "\n".join(lines) + "\n"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs event: put the generated table where a page holds the marker."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render_flags(load_parser()))
