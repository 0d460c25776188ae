"""What a llama-server binary supports, learnt from its own `--help` and cached per binary."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "llama-wrapper" / "help"


def supported_flags(binary: str) -> frozenset[str] | None:
    """The flags the binary's `--help` lists, or None when that cannot be learnt (then assume nothing)."""
    path = shutil.which(binary)
    if path is None:
        return None
    stat = os.stat(path)
    key = hashlib.sha256(f"{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    cached = cache_dir() / f"{key[:24]}.json"
    try:
        return frozenset(json.loads(cached.read_text()))
    except (OSError, ValueError):
        pass
    try:
        done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    flags = frozenset(_FLAG.findall(done.stdout + done.stderr))
    if not flags:
        return None
    cached.parent.mkdir(parents=True, exist_ok=True)
    temporary = cached.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(sorted(flags)))
    temporary.replace(cached)
    return flags
