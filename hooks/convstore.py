"""The conversation cache on disk: one entry per conversation that left a slot, in the model's slot folder (the
server's --slot-save-path, so that it restores an entry by its plain name).

An entry is a pair, committed as slot pairs are (hooks/slotdir.py): `conv-<key>-<fingerprint>.bin`, the state
llama-server wrote (its token ids first), and the sidecar `conv-<key>.json` that names it, written last. The key
is a hash of the entry's tokens: two wrappers on one folder (NFS, a ReadWriteMany volume) that save the same
conversation write the same key, each its own KV file, and the last sidecar wins; a reader only ever follows a
committed sidecar to a whole file, and a half-written file has a name no reader looks at. The folder is listed
again at each lookup, so an entry another wrapper wrote is found. The sidecar's mtime is the entry's last use.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hooks import slotdir, slotfile

PREFIX = "conv-"
_SIDECAR = re.compile(r"^conv-([0-9a-f]{16})\.json$")
_KV_FILE = re.compile(r"^conv-([0-9a-f]{16})-[0-9a-f]{12}\.bin$")
_PART = re.compile(r"^conv-[0-9a-f]{16}\.bin\.part-(.+)-(\d+)$")  # being written by host, pid
PART_AGE_S = 3600.0  # another host's part this old is litter (a writer that died)
ORPHAN_AGE_S = 60.0


def key_of(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()[:16]


def part_name(key: str) -> str:
    """Where llama-server writes an entry before it is committed: host and pid keep writers apart."""
    host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname()) or "host"
    return f"{PREFIX}{key}.bin.part-{host}-{os.getpid()}"


@dataclass
class Entry:
    key: str
    sidecar: Path
    kv_file: Path
    n_tokens: int
    bytes: int
    last_used: float
    record: dict[str, Any]
    _tokens: list[int] | None = None

    @property
    def tokens(self) -> list[int]:
        """Its token ids, read from the state file's header once."""
        if self._tokens is None:
            data, _ = slotfile.open_map(self.kv_file)
            try:
                self._tokens = slotfile.header(data, str(self.kv_file)).tokens
            finally:
                if isinstance(data, mmap.mmap):
                    data.close()
        return self._tokens

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "tokens": self.n_tokens, "bytes": self.bytes, "file": self.kv_file.name,
                "last_used": round(self.last_used, 3)}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    differ = np.flatnonzero(x != y)
    return int(differ[0]) if len(differ) else n


class Store:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._known: dict[str, Entry] = {}  # by sidecar name and mtime: tokens are read once

    def entries(self) -> list[Entry]:
        """Every committed entry now (what other wrappers committed too); unreadable ones are left out."""
        found = []
        for path in self.directory.glob(f"{PREFIX}*.json") if self.directory.is_dir() else []:
            match = _SIDECAR.match(path.name)
            if not match:
                continue
            try:
                mtime = path.stat().st_mtime
                known = self._known.get(path.name)
                if known is not None and known.last_used == mtime and known.kv_file.exists():
                    found.append(known)
                    continue
                record = slotdir.read_sidecar(path)
                kv_file = self._kv_file(path, record)
                entry = Entry(match.group(1), path, kv_file, int(record.get("tokens") or 0),
                              int(record.get("bytes") or 0), mtime, record)
            except (OSError, slotdir.SidecarError, ValueError, TypeError):
                continue
            self._known[path.name] = entry
            found.append(entry)
        return found

    def _kv_file(self, sidecar: Path, record: dict[str, Any]) -> Path:
        name = record.get("file")
        if not isinstance(name, str) or not _KV_FILE.match(name):
            raise slotdir.SidecarError(f"{sidecar.name} names an odd file: {name!r}")
        return sidecar.parent / name

    def best(self, tokens: list[int]) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with `tokens`, and how long that prefix is."""
        best: Entry | None = None
        length = 0
        for entry in self.entries():
            try:
                shared = common_prefix(entry.tokens, tokens)
            except (OSError, slotfile.SlotFileError):
                continue
            if shared > length or (shared == length and best is not None and entry.n_tokens < best.n_tokens):
                best, length = entry, shared
        return best, length

    def find(self, tokens: list[int]) -> Entry | None:
        """The entry holding exactly these tokens, if any (then a save would write nothing new)."""
        key = key_of(tokens)
        return next((e for e in self.entries() if e.key == key and e.n_tokens == len(tokens)), None)

    def commit(self, written: Path, tokens: list[int], record: dict[str, Any]) -> Entry:
        """Make a verified state file an entry; the entries it extends (its prefixes) are removed after."""
        key = key_of(tokens)
        previous = None
        with contextlib.suppress(OSError, slotdir.SidecarError):
            previous = self._kv_file(self.directory / f"{PREFIX}{key}.json",
                                     slotdir.read_sidecar(self.directory / f"{PREFIX}{key}.json"))
        final = slotdir.commit_pair(self.directory, f"{PREFIX}{key}", written,
                                    {"key": key, "tokens": len(tokens), **record}, previous)
        for entry in self.entries():
            if entry.key != key and entry.n_tokens < len(tokens) and common_prefix(entry.tokens, tokens) == \
                    entry.n_tokens:
                self.remove(entry)  # a shorter state of the same conversation: the new one holds it all
        entry = next(e for e in self.entries() if e.key == key)
        assert entry.kv_file == final or entry.kv_file.exists()
        return entry

    def touch(self, entry: Entry) -> None:
        """A hit: its last use is now (the sidecar's mtime)."""
        with contextlib.suppress(OSError):
            os.utime(entry.sidecar)
            entry.last_used = entry.sidecar.stat().st_mtime

    def remove(self, entry: Entry) -> None:
        for path in (entry.sidecar, entry.kv_file):  # the sidecar first: nothing names a half-removed pair
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._known.pop(entry.sidecar.name, None)

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries())

    def evict(self, budget: int, keep: set[str] | None = None) -> list[Entry]:
        """Remove the least recently used entries until they fit `budget` bytes."""
        entries = sorted(self.entries(), key=lambda e: e.last_used)
        total = sum(e.bytes for e in entries)
        removed = []
        for entry in entries:
            if total <= budget:
                break
            if keep and entry.key in keep:
                continue
            self.remove(entry)
            total -= entry.bytes
            removed.append(entry)
        return removed

    def free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.directory).free
        except OSError:
            return 0

    def sweep(self, now: float | None = None) -> list[str]:
        """Parts of dead writers on this host (or of any host, once an hour old) and KV files no sidecar names."""
        if not self.directory.is_dir():
            return []
        now = time.time() if now is None else now
        named = {e.kv_file.name for e in self.entries()}
        host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname()) or "host"
        removed = []
        for path in self.directory.iterdir():
            part = _PART.match(path.name)
            age = slotdir.age(path, now)
            if part:
                mine = part.group(1) == host
                litter = (mine and int(part.group(2)) != os.getpid() and not slotdir.alive(int(part.group(2)))) or \
                    age > PART_AGE_S
            else:
                litter = bool(_KV_FILE.match(path.name)) and path.name not in named and age > ORPHAN_AGE_S
            if litter:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path.name)
        return removed

