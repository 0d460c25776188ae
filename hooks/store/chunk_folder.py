"""The chunks of a slot folder (`chunks/<name>.kv`, hooks/store/chunks.py): each written once, whole, before any
manifest names it; read back into the state file llama-server restores from; removed when no manifest names
them any more.

A chunk is written to `<name>.kv.<host>-<pid>-<n>.tmp` and renamed into place, so a name is only ever a whole chunk;
one that exists already is not written again, only touched. Removing an entry removes the chunks no other
manifest names unless one was touched after that entry's last use and less than GRACE_S ago: another host may be
committing a manifest that names it (and a commit checks that its chunks are all there once its manifest is,
writing again any that went meanwhile). A kill between the chunks and the manifest leaves chunks no manifest
names: `sweep` removes them once ORPHAN_AGE_S old.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hooks import kvfile
from hooks.store import chunks, layout
from hooks.store.interface import Unavailable, Unreadable

FOLDER = "chunks"
GRACE_S = 120.0
ORPHAN_AGE_S = 600.0
_NAME = re.compile(r"^[0-9a-f]{32}$")
_FILE = re.compile(r"^([0-9a-f]{32})\.kv$")
_TEMPORARY = re.compile(r"^[0-9a-f]{32}\.kv\.([A-Za-z0-9]+)-(\d+)-\d+\.tmp$")  # host, pid, a count


def names_of(record: dict[str, Any]) -> list[str]:
    """The chunks an entry's sidecar names (none for a state kept whole)."""
    plan = record.get("chunks")
    if not isinstance(plan, dict):
        return []
    names = plan.get("names")
    return [str(n) for n in names] if isinstance(names, list) else []


def plan_problem(record: dict[str, Any]) -> str | None:
    """What makes a sidecar's chunk plan unusable (None when it has none or it is sound): a manifest from another
    host or version is read as data, never trusted."""
    plan = record.get("chunks")
    if plan is None:
        return None
    if not isinstance(plan, dict):
        return f"a chunk plan that is not one ({type(plan).__name__})"
    try:
        names = plan["names"]
        if not isinstance(names, list) or not all(isinstance(n, str) and _NAME.match(n) for n in names):
            return "names that are not chunk names"
        if len(names) != int(plan["count"]):
            return f"{len(names)} chunk names for a count of {plan['count']}"
        if chunks.chunk_size(plan) <= 0 or int(record.get("tail_bytes", -1)) < 0:
            return "no sizes"
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return f"a damaged chunk plan ({exc!r})"
    return None


def _misnamed(named: list[str], expected: list[str]) -> str | None:
    """How the names a manifest gives differ from those its tokens give (None: they are the same)."""
    if len(named) != len(expected):
        return f"names {len(named)} chunks where its tokens make {len(expected)}"
    wrong = [i for i, (a, b) in enumerate(zip(named, expected, strict=True)) if a != b]
    if not wrong:
        return None
    first = wrong[0]
    return (f"names chunk {first + 1} of {len(named)} {named[first]}, which its tokens name {expected[first]} "
            f"({len(wrong)} chunk(s) misnamed)")


def size_of(record: dict[str, Any]) -> int:
    """The bytes of each of the entry's chunks."""
    plan = record.get("chunks")
    try:
        return chunks.chunk_size(plan) if isinstance(plan, dict) else 0
    except (KeyError, TypeError, ValueError):
        return 0


class ChunkFolder:
    def __init__(self, slot_folder: Path) -> None:
        self.directory = slot_folder / FOLDER

    def path(self, name: str) -> Path:
        if not _NAME.match(name):
            raise Unreadable(f"a manifest names an odd chunk: {name!r}")
        return self.directory / f"{name}.kv"

    def has(self, name: str, size: int) -> bool:
        try:
            return self.path(name).stat().st_size == size
        except OSError:
            return False

    def write(self, cut: chunks.Split) -> int:
        """Write the chunks this folder does not hold yet; the bytes written."""
        if not cut.chunks:
            return 0
        self.directory.mkdir(parents=True, exist_ok=True)
        written = 0
        for chunk in cut.chunks:
            target = self.path(chunk.name)
            if self.has(chunk.name, chunk.size):
                with contextlib.suppress(OSError):
                    os.utime(target)  # in use again: not removed while a manifest naming it is committed
                continue
            written += self.put(chunk.name, chunk.make())
        return written

    def rewrite_missing(self, cut: chunks.Split) -> int:
        """After the manifest: write again the chunks another process removed meanwhile; the bytes written."""
        return sum(self.put(c.name, c.make()) for c in cut.chunks if not self.has(c.name, c.size))

    def put(self, name: str, data: bytes | memoryview) -> int:
        """Write one chunk whole under its name."""
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.path(name)
        temporary = target.with_name(f"{target.name}.{layout.temporary_tag()}.tmp")
        try:
            with open(temporary, "wb") as out:
                out.write(data)
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        return len(data)

    def assemble(self, tail: Path, record: dict[str, Any], into: Path, salt: str) -> int:
        """Write the state of a chunked entry (its tail and its chunks) to `into`; Unreadable when a chunk is
        missing or damaged, or the manifest names chunks its tokens do not name (`salt`: what the names are
        chained over beside the tokens)."""
        plan = record["chunks"]
        if problem := plan_problem(record):
            raise Unreadable(f"its manifest has {problem}")
        maps: list[kvfile.Buffer] = []
        try:
            tail_map, _ = kvfile.open_map(tail)
            maps.append(tail_map)
            if problem := _misnamed(names_of(record), chunks.names_for(salt, plan, kvfile.header(tail_map).tokens)):
                raise Unreadable(f"its manifest {problem}: it is not this conversation's state")
            for name in names_of(record):
                try:
                    maps.append(kvfile.open_map(self.path(name))[0])
                except FileNotFoundError as exc:
                    raise Unreadable(f"chunk {name} is missing") from exc
            with open(into, "wb") as out:
                return chunks.assemble(tail_map, maps[1:], plan, out)
        except kvfile.SlotFileError as exc:
            raise Unreadable(f"its tail: {exc}") from exc
        except (chunks.NotAssembled, KeyError, TypeError, ValueError) as exc:
            raise Unreadable(f"its chunks do not make a state: {exc}") from exc
        except OSError as exc:  # a full disk, an I/O error: not the entry's fault
            raise Unavailable(f"its state could not be assembled: {exc}") from exc
        finally:
            for each in maps:
                if isinstance(each, mmap.mmap):
                    with contextlib.suppress(BufferError):  # views of it may live on in an error's traceback
                        each.close()

    def remove(self, names: Iterable[str], named: set[str], now: float | None = None,
               min_age: float = GRACE_S, since: float | None = None) -> list[str]:
        """Remove those of `names` no manifest names (`named`), unless another process touched them within
        `min_age` — after `since` (when the manifest that named them was committed or last used), if given."""
        now = time.time() if now is None else now
        removed = []
        for name in set(names) - named:
            with contextlib.suppress(OSError, Unreadable):
                path = self.path(name)
                mtime = path.stat().st_mtime
                if now - mtime >= min_age or (since is not None and mtime <= since):
                    path.unlink()
                    removed.append(name)
        return removed

    def sweep(self, named: set[str], now: float | None = None) -> list[str]:
        """Chunks no manifest names once ORPHAN_AGE_S old, and temporaries of writers that are gone."""
        if not self.directory.is_dir():
            return []
        now = time.time() if now is None else now
        found, removed = [], []
        for path in self.directory.iterdir():
            if (match := _FILE.match(path.name)) is not None:
                found.append(match.group(1))
            elif (temporary := _TEMPORARY.match(path.name)) is not None:
                pid = int(temporary.group(2))
                ours = temporary.group(1) == layout.host_id()
                if (ours and pid != os.getpid() and not layout.alive(pid)) or layout.age(path, now) > ORPHAN_AGE_S:
                    with contextlib.suppress(OSError):
                        path.unlink()
                        removed.append(path.name)
        removed += [f"{FOLDER}/{name}.kv" for name in self.remove(found, named, now, ORPHAN_AGE_S)]
        return removed

    def bytes(self) -> int:
        """What every chunk here takes."""
        if not self.directory.is_dir():
            return 0
        total = 0
        for path in self.directory.iterdir():
            if _FILE.match(path.name):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
        return total
