"""The last decisions a built-in made (the conversation cache's restores, media's loads and drops, spec's
switches), each stamped with its time, as /wrapper/status shows them."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

KEPT = 20


class Decisions(deque[dict[str, Any]]):
    def __init__(self) -> None:
        super().__init__(maxlen=KEPT)

    def made(self, **decision: Any) -> dict[str, Any]:
        """Keep one (the oldest goes beyond KEPT); the entry, to be logged as it is kept."""
        entry = {"at": round(time.time(), 3), **decision}
        self.append(entry)
        return entry
