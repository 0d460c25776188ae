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
_COLUMNS = re.compile(r"(?<![,\s])\s{2,}")  # a help line: flags (a comma between them), 2+ spaces, the text
_FORMAT = 2  # of the cache entries; older entries (a plain list) are read again from --help


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "llama-wrapper" / "help"


def supported_flags(binary: str) -> frozenset[str] | None:
    """The flags the binary's `--help` lists, or None when that cannot be learnt (then assume nothing)."""
    arity = flag_arity(binary)
    return frozenset(arity) if arity is not None else None


def flag_arity(binary: str) -> dict[str, bool] | None:
    """Each flag `--help` lists, and whether it takes a value (a metavar follows its names); cached per binary."""
    path = shutil.which(binary)
    if path is None:
        return None
    stat = os.stat(path)
    key = hashlib.sha256(f"{_FORMAT}\0{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    cached = cache_dir() / f"{key.hexdigest()[:24]}.json"
    try:
        data = json.loads(cached.read_text())
        if isinstance(data, dict):
            return {str(k): bool(v) for k, v in data.items()}
    except (OSError, ValueError):
        pass
    try:
        done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    arity = parse_help(done.stdout + done.stderr)
    if not arity:
        return None
    cached.parent.mkdir(parents=True, exist_ok=True)
    temporary = cached.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(arity, sort_keys=True))
    temporary.replace(cached)
    return arity


def parse_help(text: str) -> dict[str, bool]:
    """Flags and their arity from help text: `-c,    --ctx-size N   description` says both take a value."""
    arity: dict[str, bool] = {}
    for line in text.splitlines():
        head = _COLUMNS.split(line.strip(), maxsplit=1)[0] if line.startswith("-") else ""
        names = [part.rstrip(",") for part in head.split() if part.startswith("-")]
        takes_value = bool(head.split()) and not head.split()[-1].startswith("-")
        for name in names:
            if _FLAG.fullmatch(name):
                arity[name] = takes_value
    for name in _FLAG.findall(text):  # flags named only in descriptions: known, arity unknown (a switch)
        arity.setdefault(name, False)
    return arity
