"""Every relative link in the Markdown pages points at a file that exists (and, with `#anchor`,
at a heading of that page), so moving or renaming a page or a heading cannot leave a dead link.

Links to other sites (`https:`, `mailto:`) are not followed: this test makes no request. Text in
fenced code blocks and inline code is not a link and is skipped.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target) and ![alt](target), with an optional "title"; the text may hold `]` only in code.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages += sorted((ROOT / "scripts").glob("*.md"))
    return [p for p in pages if p.is_file()]


def _prose(text: str) -> str:
    """The page without code: fenced blocks and inline code spans hold no links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text())):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """`page: target (why)` for each relative link in `pages` that does not resolve; pages are
    named relative to `root`."""
    broken = []
    for page in pages:
        for target in _LINK.findall(_prose(page.read_text())):
            if _SCHEME.match(target):
                continue  # another site: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where} (no such heading)")
    return broken


def test_every_relative_link_in_the_docs_resolves():
    pages = _pages()
    assert len(pages) > 10, "the page list is wrong: too few pages found"
    assert not broken_links(pages), broken_links(pages)


def test_the_checker_sees_a_broken_link(tmp_path):
    """The check itself: a missing file, a missing heading and a link hidden in code."""
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A title (`x.py`, more)\n")
    page.write_text(
        "[ok](there.md) [ok](there.md#a-title-xpy-more) [ok](#local) [web](https://example.com)\n"
        "[gone](missing.md) [bad](there.md#nope)\n"
        "`[code](not-a-link.md)`\n\n```\n[fenced](not-a-link.md)\n```\n## Local\n"
    )
    assert broken_links([page], root=tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#nope (no such heading)",
    ]
