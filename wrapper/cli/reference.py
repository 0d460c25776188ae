"""The configuration reference of docs/configuration.md, drawn from each section's one declaration:
`python -m wrapper.cli.reference docs/configuration.md` (make docs) writes it there, and a test keeps it equal."""

from __future__ import annotations

import sys
from pathlib import Path

from wrapper import built_ins

BEGIN = "<!-- the reference: `make docs` writes what follows from the declarations; a test keeps it so -->"
END = "<!-- end of the reference -->"

# where each section's feature is explained, relative to docs/
EXPLAINED = {
    "watchdog": "lifecycle.md#a-crash-or-a-hang-is-a-pause", "priority": "priority.md", "sleep": "sleep.md",
    "slots": "slots.md", "store": "store.md", "cache": "conversations.md", "media": "media.md", "spec": "spec.md",
    "degrade": "degrade.md",
}


def markdown() -> str:
    parts = []
    for section in built_ins.sections():
        where = EXPLAINED.get(section.name)
        said = f"`{section.name}:` {section.doc}" + (" (off without this section)" if section.optional else "")
        parts.append(f"### {section.name}\n\n{said}" + (f"; see [{where.split('#')[0]}]({where})." if where else ".")
                     + f"\n\n{section.table()}\n")
    return "\n".join(parts)


def written_into(text: str) -> str:
    """`text` with what stands between the markers replaced by the reference."""
    head, _, rest = text.partition(BEGIN)
    _, found, tail = rest.partition(END)
    if not found:
        raise ValueError(f"no {BEGIN!r} … {END!r} in the file")
    return f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}"


def main() -> None:
    path = Path(sys.argv[1])
    path.write_text(written_into(path.read_text()))


if __name__ == "__main__":
    main()
