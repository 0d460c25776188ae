"""The README and docs/, as the tests that check them read them: the README first, then every page under docs/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def text() -> str:
    """Every page's text, one after another (a block is looked for in all of them)."""
    return "\n".join(page.read_text() for page in pages())
