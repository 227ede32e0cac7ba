"""Every relative link of the README and the docs pages reaches a file of the checkout, and a link's `#anchor` a
heading of that page (as GitHub makes anchors), so moving a section cannot leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.snippets import DOCS

ROOT = DOCS.parent
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"^```.*?^```", re.S | re.M)  # fenced blocks: their `#` lines are comments, not headings


def prose(page: Path) -> str:
    return CODE.sub("", page.read_text())


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces as '-', repeats numbered."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#+ (.+)$", prose(page), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def test_anchors_follow_githubs_rule():
    page = DOCS / "off_policy.md"
    assert {"corrections", "mismatch-metrics", "sampling-mask-replay"} <= set(anchors(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_reaches_its_file_and_heading(page):
    dead = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in set(anchors(file)):
            dead.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    assert not dead, f"{page.relative_to(ROOT)}: dead links:\n" + "\n".join(dead)
