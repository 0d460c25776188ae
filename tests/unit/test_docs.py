"""The README and docs/ hold together: every link goes to a page that exists and an anchor one of its headings
makes, every page under docs/ is reached from the README, and the README stays short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

from tests import docs

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _outside_code(page.read_text()), re.M):
        slug, n = _slug(heading), 1
        while slug in found:  # a repeated heading gets -1, -2, ...
            slug, n = f"{_slug(heading)}-{n}", n + 1
        found.add(slug)
    return found


def _links(page: Path) -> list[tuple[Path, str]]:
    """Each local link of the page: the file it names (the page itself for `#anchor`) and its anchor."""
    found = []
    for target in LINK.findall(_outside_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        found.append(((page.parent / path).resolve() if path else page, anchor))
    return found


def test_every_link_goes_to_a_page_and_a_heading_that_exist() -> None:
    broken = []
    for page in docs.pages():
        for target, anchor in _links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(docs.ROOT)}: {target.relative_to(docs.ROOT)} does not exist")
            elif anchor and (target.suffix != ".md" or anchor not in _anchors(target)):
                broken.append(f"{page.relative_to(docs.ROOT)}: no heading #{anchor} in {target.relative_to(docs.ROOT)}")
    assert not broken, "\n".join(broken)


def test_every_page_is_reached_from_the_readme() -> None:
    reached, todo = set(), [docs.ROOT / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached or page.suffix != ".md" or not page.is_file():
            continue
        reached.add(page)
        todo += [target for target, _ in _links(page)]
    unreached = [str(p.relative_to(docs.ROOT)) for p in docs.pages() if p not in reached]
    assert not unreached, unreached


def test_the_readme_reads_in_ten_minutes() -> None:
    readme = (docs.ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400 and len(readme.split()) <= 4000


def test_the_slug_is_githubs() -> None:
    assert _slug("Sleep: an idle model gives its memory back") == "sleep-an-idle-model-gives-its-memory-back"
    assert _slug("Recipe: a 27B model on a 24 GB GPU behind llama-swap") == \
        "recipe-a-27b-model-on-a-24-gb-gpu-behind-llama-swap"
    assert _slug("The `cache:` section") == "the-cache-section"
