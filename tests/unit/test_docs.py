"""The documentation holds together: the README opens with the two commands a new user runs,
and every relative link of it, of ``docs/`` and of the benchmark notebook names a file that
exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "bench" / "NOTEBOOK.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def test_the_readme_opens_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    fence = lines.index("```sh")
    assert fence < 5
    assert [line.split()[:2] for line in lines[fence + 1 : fence + 3]] == [
        ["make", "run"],
        ["make", "test"],
    ]


def test_every_relative_link_of_the_documentation_resolves() -> None:
    assert sum(len(_relative_links(p)) for p in PAGES) > 10, "the scan found the links"
    broken = [
        f"{p.relative_to(ROOT)}: {t}"
        for p in PAGES
        for t in _relative_links(p)
        if not (p.parent / t).exists()
    ]
    assert broken == []
