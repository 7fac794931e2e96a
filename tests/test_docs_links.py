"""The documentation's links resolve, and docs/ holds documents only (issue 50).

Every relative link in README.md and the Markdown under docs/ (``[text](path)``, ``![alt](path)``,
``[text](path#anchor)`` and reference definitions ``[label]: path``) names a file or folder that
exists, resolved from the linking file's folder. Web and mail links and links to an anchor of the
same page are not checked; nor is text inside fenced code blocks or inline code spans, which is
code, not a link. The top level of docs/ holds only .md documents and folders: results (JSON,
plots, generated tables) live in docs/results/.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.M)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")   # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def links(text: str) -> list[str]:
    """The link targets of a Markdown text, outside code."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    found = [m.group(1) for m in INLINE.finditer(text)] + [m.group(1) for m in REFERENCE.finditer(text)]
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in found]


def relative_target(target: str) -> str | None:
    """The path part of a relative link, or None for a link this test does not check."""
    if EXTERNAL.match(target) or target.startswith(("#", "//")):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    return path or None


def test_the_link_parser():
    text = "\n".join([
        "[a](docs/a.md) ![plot](results/p.png) [b](b.md#section) [`c.md`](c.md \"title\")",
        "[web](https://example.com) [mail](mailto:x@y.z) [here](#anchor) [spaced](<d e.md>)",
        "`[not](code.md)` and", "```", "[nor](fenced.md)", "```", "[ref]: ref.md",
    ])
    assert [relative_target(t) for t in links(text)] == [
        "docs/a.md", "results/p.png", "b.md", "c.md", None, None, None, "d e.md", "ref.md"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path):
    broken = []
    for target in links(path.read_text(encoding="utf-8")):
        relative = relative_target(target)
        if relative is None:
            continue
        resolved = (ROOT / relative.lstrip("/")) if relative.startswith("/") else (path.parent / relative)
        if not resolved.exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to files that do not exist: {broken}"


def test_docs_top_level_holds_documents_only():
    stray = sorted(p.name for p in DOCS.iterdir() if not p.is_dir() and p.suffix != ".md")
    assert not stray, f"docs/ holds documents only; move these results into docs/results/: {stray}"
