"""What long work is doing now (starting, a restore, a conversion, a reload stage, a drain, a save): shown in
/wrapper/status as `progress` and logged (`progress`) at least every 2 s while it lasts, by the supervisor."""

from __future__ import annotations

import time
from typing import Any


class Progress:
    def __init__(self) -> None:
        self.phase: str | None = None
        self.began = 0.0
        self.details: dict[str, Any] = {}

    def begin(self, phase: str, **details: Any) -> None:
        self.phase, self.began, self.details = phase, time.monotonic(), dict(details)

    def update(self, **details: Any) -> None:
        """Details of the phase (a built-in's restore, a conversion); may be called from a worker thread."""
        self.details = {**self.details, **details}

    def end(self) -> None:
        self.phase, self.details = None, {}

    def snapshot(self) -> dict[str, Any] | None:
        if self.phase is None:
            return None
        return {"phase": self.phase, "for_s": round(time.monotonic() - self.began, 1), **self.details}


PROGRESS = Progress()
