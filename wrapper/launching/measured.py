"""What the wrapper measured on this machine, kept across its runs: one small JSON file per model (and setup) in
the user cache (`~/.cache/llama-wrapper/rates/`, never the shared slot folder), written whole — a temporary
renamed over it — and at most every `every_s` unless asked now (a rate that moved a little waits)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from wrapper.launching.flags import wrapper_cache

_TEMPORARY = re.compile(r"\.json\.(\d+)\.tmp$")
_swept: set[Path] = set()


def rates_dir() -> Path:
    return wrapper_cache() / "rates"


def sweep(directory: Path) -> list[str]:
    """The temporaries of writers that died before their rename (once per process and folder)."""
    if directory in _swept or not directory.is_dir():
        return []
    _swept.add(directory)
    removed = []
    for path in directory.iterdir():
        found = _TEMPORARY.search(path.name)
        if found and int(found.group(1)) != os.getpid() and not _alive(int(found.group(1))):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MeasuredFile:
    def __init__(self, name: str, every_s: float = 10.0) -> None:
        self.path = rates_dir() / f"{name}.json"
        self.every_s = every_s
        self._written = 0.0
        sweep(self.path.parent)

    def read(self) -> dict[str, Any]:
        """What was written last; {} when nothing was, or it cannot be read."""
        with contextlib.suppress(OSError, ValueError):
            found = json.loads(self.path.read_text())
            if isinstance(found, dict):
                return found
        return {}

    def write(self, data: dict[str, Any], now: bool = False) -> None:
        """Write `data` (unless written within `every_s` and not `now`); a full disk loses only this write."""
        if not now and time.monotonic() - self._written <= self.every_s:
            return
        self._written = time.monotonic()
        temporary = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text(json.dumps(data))
            os.replace(temporary, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                temporary.unlink()  # a full disk: no half-written temporary left behind
