"""The README is the front door: short, the two commands first, and every relative link in it
points at a file of the repository (the docs site's own links are checked by
``mkdocs build --strict`` in scripts/test.sh)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code blocks that are neither URLs nor in-page anchors."""
    prose = _FENCE.sub("", markdown)
    targets = (m.group(1) for m in _LINK.finditer(prose))
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t)]


def test_relative_links_resolve() -> None:
    links = relative_links(README.read_text())
    assert links, "the README links into docs/"
    missing = [t for t in links if not (ROOT / t.split("#", 1)[0]).exists()]
    assert missing == []


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 250
    first_block = _FENCE.search(text)
    assert first_block is not None
    assert "bash scripts/serve.sh" in first_block.group(0)
    assert "bash scripts/test.sh" in first_block.group(0)


def test_the_link_finder_sees_links_and_skips_urls_anchors_and_code() -> None:
    text = (
        "[a](docs/a.md) ![i](docs/i.png) [u](https://x.org) [h](#here) [m](mailto:x@y)\n"
        "```\n[c](docs/in-code.md)\n```\n[b](docs/b.md#part)\n"
    )
    assert relative_links(text) == ["docs/a.md", "docs/i.png", "docs/b.md#part"]
