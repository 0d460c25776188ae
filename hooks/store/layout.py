"""A model's slot folder: how a pair (a KV file and the sidecar naming it) is committed as one, what each
host's slots held at its last stop, what is litter.

A pair's sidecar `<stem>.json` names its KV file `<stem>-<fingerprint>.bin` and that file's size and
fingerprint. A commit writes the new KV file under its own name, then replaces the sidecar (the one atomic
step), then removes the old KV file. Killed at any point, the folder holds either the old pair or the new one,
both whole; what is left over is removed at the next start.

Saved states are entries `conv-<key>` named by what they hold (hooks/store/folder.py); what each slot of a host
held at its last stop is that host's note `held-<host>.json` (slot -> entry key), so hosts sharing a folder
never overwrite each other's states. Folders of the earlier layouts (per slot `slotN.json` naming
`slotN-<fingerprint>.bin`, or `slotN.bin` beside it) are still read: a slot a note does not name keeps its pair
until a save of that slot replaces it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wrapper.launching.model import fingerprint

SIDECAR_FORMAT = 1
_SIDECAR = re.compile(r"^slot(\d+)\.json$")
_KV_FILE = re.compile(r"^slot(\d+)(?:-[0-9a-f]{12})?\.bin$")
_TEMPORARY = re.compile(r"\.(\d+)\.(?:tmp|bin)$")  # `<name>.<pid>.tmp`, and the version probe `.<pid>.bin`
_FETCHED = re.compile(r"\.bin\.([A-Za-z0-9]+)-(\d+)-\d+\.tmp$")  # a tail being fetched: `<name>.<tag>.tmp`
_TAGS = itertools.count()
ORPHAN_AGE_S = 60.0  # a KV file no sidecar names is litter once this old (younger: a save may be committing it)


class SidecarError(ValueError):
    """A sidecar that is missing, unreadable, or does not describe its KV file."""


ENTRY_PREFIX = "conv-"
_NOTE = re.compile(r"^held-([A-Za-z0-9]+)\.json$")
_KEY = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class SavedSlot:
    slot: int
    sidecar: Path
    kv_file: Path
    key: str | None = None  # the entry a host's note names; None for a pair of the earlier layout


@dataclass(frozen=True)
class NoteLine:
    """One slot of a host's note."""

    slot: int
    key: str
    n_tokens: int


def host_id() -> str:
    """This host's name in its note (two wrappers of one model on one host share it: the last stop wins)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname()) or "host"


def temporary_tag() -> str:
    """`<host>-<pid>-<n>`: a temporary of its own for every writer, threads of one process included (two slots
    saving one shared beginning write the same chunk at once)."""
    return f"{host_id()}-{os.getpid()}-{next(_TAGS)}"


def entry_sidecar(directory: Path, key: str) -> Path:
    return directory / f"{ENTRY_PREFIX}{key}.json"


def sidecar_path(directory: Path, slot: int) -> Path:
    return directory / f"slot{slot}.json"


def read_sidecar(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SidecarError(f"{path.name}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise SidecarError(f"{path.name} is not a llama-wrapper sidecar of format {SIDECAR_FORMAT}")
    return data


def kv_file_of(sidecar: Path, data: dict[str, Any]) -> Path:
    """The KV file a sidecar names (`slotN.bin` for the older layout)."""
    name = data.get("file")
    if name is None:
        return sidecar.with_suffix(".bin")
    if not isinstance(name, str) or not _KV_FILE.match(name):
        raise SidecarError(f"{sidecar.name} names an odd file: {name!r}")
    return sidecar.parent / name


def saved_slots(directory: Path, host: str | None = None) -> list[SavedSlot]:
    """What each slot held at the host's last stop (its note, else the newest note of another host), with the
    pairs of the earlier layout for slots no note names; the KV files may be missing: check before use."""
    _, noted = note_of(directory, host or host_id())
    found = {saved.slot: saved for saved in legacy_slots(directory)}
    for slot, entry in noted.items():
        sidecar = entry_sidecar(directory, entry.key)
        try:
            kv_file = kv_file_of(sidecar, read_sidecar(sidecar))
        except SidecarError:
            kv_file = sidecar.with_suffix(".bin")
        found[slot] = SavedSlot(slot, sidecar, kv_file, entry.key)
    return [found[slot] for slot in sorted(found)]


def note_of(directory: Path, host: str) -> tuple[Path | None, dict[int, NoteLine]]:
    """The host's note (else the newest of another host's: a host of a new name takes over) and its slots."""
    notes = {match.group(1): path for path in (directory.glob("held-*.json") if directory.is_dir() else [])
             if (match := _NOTE.match(path.name))}
    chosen = notes.get(host) or max(notes.values(), key=_mtime, default=None)
    if chosen is None:
        return None, {}
    try:
        data = read_sidecar(chosen)
        return chosen, {int(slot): NoteLine(int(slot), str(held["entry"]), int(held.get("tokens") or 0))
                        for slot, held in dict(data["slots"]).items() if _KEY.match(str(held["entry"]))}
    except (SidecarError, KeyError, TypeError, ValueError, AttributeError):
        return chosen, {}


def write_note(directory: Path, host: str, slots: dict[int, NoteLine]) -> None:
    """Replace the host's note in one step."""
    data = {"format": SIDECAR_FORMAT, "host": host, "saved_at": time.time(),
            "slots": {str(n.slot): {"entry": n.key, "tokens": n.n_tokens} for n in sorted(slots.values(),
                                                                                     key=lambda n: n.slot)}}
    _write_json(directory / f"held-{host}.json", data)


def drop_from_notes(directory: Path, keys: set[str]) -> None:
    """Every host's note forgets these entries (they were removed)."""
    for path in directory.glob("held-*.json") if keys and directory.is_dir() else []:
        match = _NOTE.match(path.name)
        _, noted = note_of(directory, match.group(1)) if match else (None, {})
        if match and any(n.key in keys for n in noted.values()):
            write_note(directory, match.group(1), {s: n for s, n in noted.items() if n.key not in keys})


def legacy_slots(directory: Path) -> list[SavedSlot]:
    """Every slot that has a sidecar of the earlier layout, with the KV file it names."""
    found = []
    for path in directory.glob("slot*.json") if directory.is_dir() else []:
        match = _SIDECAR.match(path.name)
        if not match:
            continue
        try:
            kv_file = kv_file_of(path, read_sidecar(path))
        except SidecarError:
            kv_file = path.with_suffix(".bin")
        found.append(SavedSlot(int(match.group(1)), path, kv_file))
    return sorted(found, key=lambda saved: saved.slot)


def check_pair(sidecar: dict[str, Any], kv_file: Path) -> None:
    """Raise SidecarError unless `sidecar` describes `kv_file` as it is now (size, and fingerprint if recorded)."""
    try:
        size = kv_file.stat().st_size
    except OSError as exc:
        raise SidecarError(f"the KV file {kv_file.name} is missing: {exc.strerror}") from exc
    recorded_size = sidecar.get("tail_bytes", sidecar.get("bytes"))  # a chunked entry's file is its tail
    if recorded_size != size:
        raise SidecarError(f"the sidecar does not describe {kv_file.name} ({recorded_size} bytes recorded, "
                           f"{size} found): an interrupted save?")
    recorded = sidecar.get("fingerprint")
    if recorded is not None and recorded != fingerprint(str(kv_file)):
        raise SidecarError(f"{kv_file.name} is not the file its sidecar describes (fingerprint differs)")


def commit(directory: Path, slot: int, written: Path, record: dict[str, Any]) -> Path:
    """Make `written` (a verified KV file) slot `slot`'s current save; the previous pair stays whole until then."""
    return commit_pair(directory, f"slot{slot}", written, {"slot": slot, **record}, _current_kv_file(directory, slot))


def commit_pair(directory: Path, stem: str, written: Path, record: dict[str, Any], previous: Path | None,
                state_bytes: int | None = None) -> Path:
    """Move `written` to `<stem>-<fingerprint>.bin`, then replace the sidecar `<stem>.json` that names it (the
    one atomic step), then remove the `previous` KV file. Two writers of one stem (two wrappers on one folder)
    each write their own KV file; the last sidecar wins and always names a whole file. `state_bytes`: the size
    of the state when `written` is only its tail (the rest in chunks the record names)."""
    file_fingerprint = fingerprint(str(written))
    final = directory / f"{stem}-{file_fingerprint[:12]}.bin"
    os.replace(written, final)
    size = final.stat().st_size
    data = {"format": SIDECAR_FORMAT, **record, "file": final.name, "bytes": size, "fingerprint": file_fingerprint}
    if state_bytes is not None:
        data.update(bytes=state_bytes, tail_bytes=size)
    else:
        data.pop("tail_bytes", None)  # kept whole: the file is the state
    _write_json(directory / f"{stem}.json", data)  # the commit: from here on the new pair is the current one
    if previous is not None and previous != final:
        with contextlib.suppress(OSError):
            previous.unlink()
    return final


def write_sidecar(target: Path, data: dict[str, Any]) -> None:
    """Write a sidecar whole (a fetched entry's, whose files are in place already)."""
    _write_json(target, {"format": SIDECAR_FORMAT, **data})


def _write_json(target: Path, data: dict[str, Any]) -> None:
    temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as out:
        json.dump(data, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, target)
    fsync_directory(directory=target.parent)


def remove_legacy(directory: Path, slots: set[int]) -> list[Path]:
    """Remove the earlier layout's pairs of these slots (a note names what they hold now)."""
    return [path for saved in legacy_slots(directory) if saved.slot in slots for path in remove(saved)]


def remove(saved: SavedSlot) -> list[Path]:
    """Remove a slot's sidecar first (then nothing points at a half-removed pair), then its KV files."""
    removed = []
    for path in (saved.sidecar, saved.kv_file, *saved.sidecar.parent.glob(f"slot{saved.slot}-*.bin")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


SET_ASIDE = "set-aside"


def set_aside(sidecar: Path, kv_file: Path, reason: str) -> Path:
    """Move a pair that made the server fail out of the way (`<dir>/set-aside/`), with a note of why: it is
    kept for a look, never restored again. The KV file goes first, then the sidecar (nothing points at a
    half-moved pair)."""
    folder = sidecar.parent / SET_ASIDE
    folder.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for path in (kv_file, sidecar):
        with contextlib.suppress(FileNotFoundError):
            path.replace(folder / f"{stamp}-{path.name}")
    note = folder / f"{stamp}-{sidecar.stem}.reason.txt"
    note.write_text(reason + "\n")
    return folder


def sweep(directory: Path, now: float | None = None) -> list[str]:
    """Remove what dead saves left: temporaries of processes that are gone, KV files no sidecar names."""
    if not directory.is_dir():
        return []
    now = time.time() if now is None else now
    current = {saved.kv_file.name for saved in legacy_slots(directory)}
    removed = []
    for path in directory.iterdir():
        temporary = _TEMPORARY.search(path.name)
        fetched = _FETCHED.search(path.name)
        if temporary and int(temporary.group(1)) != os.getpid() and not alive(int(temporary.group(1))):
            litter = True
        elif fetched:  # another host's only once an hour old: it may be fetching into a shared folder
            pid = int(fetched.group(2))
            litter = (fetched.group(1) == host_id() and pid != os.getpid() and not alive(pid)) or \
                age(path, now) > 3600
        elif _KV_FILE.match(path.name) and path.name not in current:
            litter = age(path, now) > ORPHAN_AGE_S
        else:
            litter = False
        if litter:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path.name)
    return removed


def _current_kv_file(directory: Path, slot: int) -> Path | None:
    path = sidecar_path(directory, slot)
    try:
        return kv_file_of(path, read_sidecar(path))
    except SidecarError:
        return None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def age(path: Path, now: float) -> float:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return 0.0


def fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
