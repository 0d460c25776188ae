"""What a llama-server binary supports, learnt from its own `--help` and cached per binary.

Within `planning()` (`llama-wrapper plan`) nothing is written: the binary is asked, its answer is not cached,
and a binary that is not found is no error (the launch plans for it as if it had every flag).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger()
_ASKED: dict[Path, Any] = {}  # answers that could not be cached on disk

_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")
_COLUMNS = re.compile(r"(?<![,\s])\s{2,}")  # a help line: flags (a comma between them), 2+ spaces, the text
_FORMAT = 2  # of the cache entries; older entries (a plain list) are read again from --help
# While planning: what the binaries said so far, kept in memory only (binary, option -> parsed answer)
_PLANNING: ContextVar[dict[tuple[str, str], Any] | None] = ContextVar("planning", default=None)


@contextmanager
def planning() -> Iterator[None]:
    """Prepare a launch only to plan it: write nothing (no cache entry, no slot folder; each answer is kept in
    memory for the plan's life), and take a binary that is not found for one that has every flag."""
    token = _PLANNING.set({})
    try:
        yield
    finally:
        _PLANNING.reset(token)


def is_planning() -> bool:
    return _PLANNING.get() is not None


def wrapper_cache() -> Path:
    """This machine's cache of what the wrapper learnt: `$XDG_CACHE_HOME/llama-wrapper` (else ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "llama-wrapper"


def cache_dir() -> Path:
    """Where the binaries' `--help` answers are kept."""
    return wrapper_cache() / "help"


def supported_flags(binary: str) -> frozenset[str] | None:
    """The flags the binary's `--help` lists, or None when that cannot be learnt (then assume nothing)."""
    arity = flag_arity(binary)
    return frozenset(arity) if arity is not None else None


def flag_arity(binary: str) -> dict[str, bool] | None:
    """Each flag `--help` lists, and whether it takes a value (a metavar follows its names); cached per binary."""
    data = _asked(binary, "--help", lambda text: parse_help(text) or None)
    return {str(k): bool(v) for k, v in data.items()} if isinstance(data, dict) else None


def unknown_flags(argv: list[str]) -> list[str]:
    """The flags of a command line (the binary first) that the binary's `--help` does not list; none when that
    cannot be learnt. A value that follows a flag taking one is not a flag, whatever it begins with."""
    arity = flag_arity(argv[0]) if argv else None
    if arity is None:
        return []
    unknown, takes_value = [], False
    for token in argv[1:]:
        if takes_value:
            takes_value = False
            continue
        if not token.startswith("-") or _NUMBER.fullmatch(token):
            continue
        name, has_value, _ = token.partition("=")
        if name not in arity:
            unknown.append(name)
        takes_value = arity.get(name, False) and not has_value
    return unknown


_NUMBER = re.compile(r"-[0-9.]+")


def devices(binary: str) -> list[str] | None:
    """The accelerators the binary sees (`--list-devices`: e.g. `CUDA0: NVIDIA H200 (143771 MiB, …)`); [] on a
    CPU-only build, None when that cannot be learnt."""
    data = _asked(binary, "--list-devices", parse_devices)
    return [str(d) for d in data] if isinstance(data, list) else None


def parse_devices(text: str) -> list[str] | None:
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith("Available devices")]
    if not starts:
        return None
    found = [line.strip() for line in lines[starts[-1] + 1:] if line.startswith(" ") and line.strip()]
    return [line for line in found if line != "(none)"]


def _asked(binary: str, option: str, parse: Any) -> Any:
    """What `binary option` says, parsed; cached per binary (path, size and mtime) under the user cache (while
    planning: read from it, never written)."""
    path = shutil.which(binary)
    if path is None:
        return None
    stat = os.stat(path)
    key = hashlib.sha256(f"{_FORMAT}\0{os.path.realpath(path)}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    suffix = "" if option == "--help" else option.strip("-") + "-"
    cached = cache_dir() / f"{suffix}{key.hexdigest()[:24]}.json"
    if cached in _ASKED:
        return _ASKED[cached]
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    planned = _PLANNING.get()
    if planned is not None and (path, option) in planned:
        return planned[path, option]
    try:
        done = subprocess.run([path, option], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parsed = parse(done.stdout + done.stderr)
    if planned is not None:  # a plan writes nothing
        planned[path, option] = parsed
        return parsed
    if parsed is None:
        return None
    try:  # a cache: a home that cannot be written costs the next start one more probe, nothing else
        cached.parent.mkdir(parents=True, exist_ok=True)
        temporary = cached.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(parsed, sort_keys=True))
        temporary.replace(cached)
    except OSError as exc:
        _ASKED[cached] = parsed  # asked once per process, then
        log.warning("cache.unwritable", file=str(cached), error=str(exc),
                    hint="set XDG_CACHE_HOME to a folder this user can write")
    return parsed


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
