"""Every relative link and anchor in README.md and docs/ resolves, and every repository path the
docs name in code (`bench/results/core.json`) exists: pages moved or renamed must not leave
readers at a dead end. Anchors are GitHub's: a heading lowercased, punctuation but `-` and `_`
dropped, spaces to `-`, repeats numbered."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
# A code span naming a file of this repository: a path under one of its top-level folders.
REPO_PATH = re.compile(r"^(?:outlast|bench|tests|examples|scripts|docs|packaging)/[\w./-]*[\w/]$")


def prose(text: str) -> str:
    return FENCE.sub("", text)


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower().replace("`", "")).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(CODE.sub("", prose(page.read_text())))]


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, mailto: ...: not ours to check offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path):
    assert not broken_links(page), f"fix these links in {page.relative_to(ROOT)}: {broken_links(page)}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_in_the_docs_exists(page: Path):
    named = {m.group(1) for m in CODE.finditer(prose(page.read_text())) if REPO_PATH.match(m.group(1))}
    # What the tests write (screenshots) is named by .gitignore and exists only once they ran.
    generated = {line.strip().lstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
    missing = sorted(p for p in named if not (ROOT / p).exists() and p not in generated)
    assert not missing, f"{page.relative_to(ROOT)} names files that are not in the repository: {missing}"


def test_the_checker_sees_a_broken_link_and_anchor(tmp_path: Path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# A `code` title, with punctuation!\n\n## Twice\n\n## Twice\n")
    page.write_text(
        "[ok](other.md#a-code-title-with-punctuation) [ok](other.md#twice-1) [ok](#here)\n"
        "[gone](missing.md) [no anchor](other.md#nowhere) [no anchor](other.md#twice-2)\n"
        "`[in code](missing2.md)`\n```\n[in a fence](missing3.md)\n```\n# Here\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        bad = broken_links(page)
    finally:
        ROOT = saved
    assert [b.split(":")[0] for b in bad] == ["missing.md", "other.md#nowhere", "other.md#twice-2"]
