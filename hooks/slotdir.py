"""A model's slot folder: which saved pair is current, how a new pair replaces it as one, what is litter.

Per slot N the sidecar `slotN.json` is the record of the current save: it names its KV file
`slotN-<fingerprint>.bin` and that file's size and fingerprint. A save writes the new KV file under its own
name, then replaces the sidecar (the one atomic step), then removes the old KV file. Killed at any point, the
folder holds either the old pair or the new one, both whole; what is left over is removed at the next start.
Folders written before this layout (`slotN.bin` beside `slotN.json`) are still read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wrapper.model import fingerprint

SIDECAR_FORMAT = 1
_SIDECAR = re.compile(r"^slot(\d+)\.json$")
_KV_FILE = re.compile(r"^slot(\d+)(?:-[0-9a-f]{12})?\.bin$")
_TEMPORARY = re.compile(r"\.(\d+)\.(?:tmp|bin)$")  # `<name>.<pid>.tmp`, and the version probe `.<pid>.bin`
ORPHAN_AGE_S = 60.0  # a KV file no sidecar names is litter once this old (younger: a save may be committing it)


class SidecarError(ValueError):
    """A sidecar that is missing, unreadable, or does not describe its KV file."""


@dataclass(frozen=True)
class SavedSlot:
    slot: int
    sidecar: Path
    kv_file: Path


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


def saved_slots(directory: Path) -> list[SavedSlot]:
    """Every slot that has a sidecar, with the KV file it names (which may be missing: check before use)."""
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
    if sidecar.get("bytes") != size:
        raise SidecarError(f"the sidecar does not describe {kv_file.name} ({sidecar.get('bytes')} bytes recorded, "
                           f"{size} found): an interrupted save?")
    recorded = sidecar.get("fingerprint")
    if recorded is not None and recorded != fingerprint(str(kv_file)):
        raise SidecarError(f"{kv_file.name} is not the file its sidecar describes (fingerprint differs)")


def commit(directory: Path, slot: int, written: Path, record: dict[str, Any]) -> Path:
    """Make `written` (a verified KV file) slot `slot`'s current save; the previous pair stays whole until then."""
    return commit_pair(directory, f"slot{slot}", written, {"slot": slot, **record}, _current_kv_file(directory, slot))


def commit_pair(directory: Path, stem: str, written: Path, record: dict[str, Any], previous: Path | None) -> Path:
    """Move `written` to `<stem>-<fingerprint>.bin`, then replace the sidecar `<stem>.json` that names it (the
    one atomic step), then remove the `previous` KV file. Two writers of one stem (two wrappers on one folder)
    each write their own KV file; the last sidecar wins and always names a whole file."""
    file_fingerprint = fingerprint(str(written))
    final = directory / f"{stem}-{file_fingerprint[:12]}.bin"
    os.replace(written, final)
    data = {"format": SIDECAR_FORMAT, **record, "file": final.name, "bytes": final.stat().st_size,
            "fingerprint": file_fingerprint}
    target = directory / f"{stem}.json"
    temporary = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as out:
        json.dump(data, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, target)  # the commit: from here on the new pair is the current one
    fsync_directory(directory)
    if previous is not None and previous != final:
        with contextlib.suppress(OSError):
            previous.unlink()
    return final


def remove(saved: SavedSlot) -> list[Path]:
    """Remove a slot's sidecar first (then nothing points at a half-removed pair), then its KV files."""
    removed = []
    for path in (saved.sidecar, saved.kv_file, *saved.sidecar.parent.glob(f"slot{saved.slot}-*.bin")):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


SET_ASIDE = "set-aside"


def set_aside(saved: SavedSlot, reason: str) -> Path:
    """Move a pair that made the server fail out of the way (`<dir>/set-aside/`), with a note of why: it is
    kept for a look, never restored again. The KV file goes first, then the sidecar (nothing points at a
    half-moved pair)."""
    folder = saved.sidecar.parent / SET_ASIDE
    folder.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for path in (saved.kv_file, saved.sidecar):
        with contextlib.suppress(FileNotFoundError):
            path.replace(folder / f"{stamp}-{path.name}")
    note = folder / f"{stamp}-slot{saved.slot}.reason.txt"
    note.write_text(reason + "\n")
    return folder


def sweep(directory: Path, now: float | None = None) -> list[str]:
    """Remove what dead saves left: temporaries of processes that are gone, KV files no sidecar names."""
    if not directory.is_dir():
        return []
    now = time.time() if now is None else now
    current = {saved.kv_file.name for saved in saved_slots(directory)}
    removed = []
    for path in directory.iterdir():
        temporary = _TEMPORARY.search(path.name)
        if temporary and int(temporary.group(1)) != os.getpid() and not alive(int(temporary.group(1))):
            litter = True
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
