"""Every relative link in README.md and docs/ names a file that exists and a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings (a repeated one gets -1, -2, ...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """The relative links of ``page`` outside code blocks, with their line numbers."""
    found: list[tuple[int, str]] = []
    in_code = False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code:
            found += [(number, target) for target in LINK.findall(line)]
    return [(n, t) for n, t in found if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for number, target in links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{page.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
