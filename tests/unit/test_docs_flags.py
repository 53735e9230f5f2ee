"""The launcher flags page of the docs site is generated from the launcher's own parser.

``docs/hooks/flags.py`` is the MkDocs hook that renders it; these tests load that hook as
MkDocs does (from its file) and check that every option of ``genserve.config.build_parser()``
lands in the page with its environment variables and default, so the page cannot drift.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

from genserve.config import FLAGS, Config, build_parser

ROOT = Path(__file__).resolve().parents[2]


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "genserve_docs_flags", ROOT / "docs/hooks/flags.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(table: str) -> dict[str, str]:
    """First cell (the flag names) → the whole row, for the table's body rows."""
    rows = {}
    for line in table.splitlines()[2:]:
        rows[line.split(" | ")[0].removeprefix("| ")] = line
    return rows


def test_every_parser_option_is_a_row_of_the_page() -> None:
    hook = _hook()
    parser = build_parser()
    page = hook.on_page_markdown(f"# Flags\n\n{hook.MARKER}\n\nafter\n")
    assert hook.MARKER not in page
    assert page.startswith("# Flags\n\n| flag |") and page.endswith("\n\nafter\n")
    rows = _rows(page.split("\n\n")[1])
    options = [
        a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]
    assert len(rows) == len(options)
    for action in options:
        assert ", ".join(f"`{name}`" for name in action.option_strings) in rows


def test_rows_carry_env_vars_and_defaults_from_the_code() -> None:
    rows = _rows(_hook().render_flags(build_parser()))
    defaults = Config()
    for flag in FLAGS:
        names = [*flag.names]
        if flag.negatable:  # argparse's --no- form beside each name
            names = [n for name in flag.names for n in (name, "--no-" + name[2:])]
        row = rows[", ".join(f"`{name}`" for name in names)]
        for env in filter(None, flag.env):
            assert f"`{env}`" in row.split(" | ")[1]
        default = getattr(defaults, flag.dest)
        cell = row.split(" | ")[2]
        if flag.negatable:  # decided by the launcher (serving_defaults)
            assert default is None and cell == "`auto`"
        elif flag.parse is None:
            assert cell == "off"
        elif isinstance(default, (int, float, str)):
            assert cell == f"`{default}`"
    assert rows["`--env`, `-e`"].split(" | ")[1] == ""  # no variable, as TGI
    assert "`int4`" in rows["`--quantize`"]  # choices are listed


def test_the_flags_page_holds_the_marker() -> None:
    page = (ROOT / "docs/launcher/flags.md").read_text()
    assert _hook().MARKER in page


def test_other_pages_pass_through_unchanged() -> None:
    text = "# Any page\n\nno marker here\n"
    assert _hook().on_page_markdown(text, page=None, config=None, files=None) == text
