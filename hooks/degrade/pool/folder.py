"""A memory pool shared by the wrappers that name one folder (`degrade.pool: DIR`): the folder is the whole
protocol. No daemon, no port: every change is made under one lock (`flock` on DIR/lock, released by the
kernel when its holder dies) and every file is written whole (a temporary file renamed over it), so a member
killed at any moment leaves the pool readable and consistent.

    DIR/pool.json             {"format", "version", "total", "source", "device", "created"}
    DIR/members/<pid>.json    one member: its share (the bytes its plan uses now), floor, busy, rung, n_ctx
    DIR/asks/<id>.json        a member asking another to give bytes back (or to sleep: `kind`), and the answer
    DIR/moves.jsonl           what was given: who asked, how much, who gave what, how long (the last ones)

A member whose pid is gone (or now names another process) is dead: its record and asks are removed by
whoever reads them next, and its share is free again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from wrapper.configuration.config import ConfigError
from wrapper.configuration.units import format_size

FORMAT = "llama-wrapper pool"
VERSION = 1
MOVES_KEPT = 100


class PoolError(ConfigError):
    """The pool folder cannot be used as it is: the message says what to do."""


@dataclass
class Member:
    pid: int
    model: str
    share: int  # bytes its plan uses now on the pool's device
    floor: int = 0  # the least it could use while holding what it serves now
    busy: bool = False  # serving a request
    rung: str = ""
    n_ctx: int = 0
    asking: bool = False  # waiting for others to give: it gives nothing meanwhile
    serving: bool = False  # it answers asks (from ready to its stop); one still starting is not asked
    started: str = ""  # the process's start time (/proc), so that a reused pid is not taken for it
    idle_since: float = 0.0  # time.time() since which it serves nothing (0 while busy)
    sleeps_when_asked: float = 0.0  # its sleep.when_asked in seconds (0: never asked to sleep)
    asleep: bool = False  # its llama-server stopped to sleep: its share is 0 until a wake fits it again
    at: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        return f"{self.model}[{self.pid}]"

    def spare(self) -> int:
        return max(0, self.share - self.floor)

    def may_sleep(self, now: float) -> bool:
        """It may be asked to sleep: awake, idle for at least its sleep.when_asked, holding a share."""
        return self.serving and not self.asleep and not self.busy and not self.asking and self.share > 0 \
            and self.sleeps_when_asked > 0 and self.idle_since > 0 and now - self.idle_since >= self.sleeps_when_asked


@dataclass
class Request:
    id: str
    asker: int
    asker_model: str
    giver: int
    bytes: int
    at: float = field(default_factory=time.time)
    state: str = "asked"  # asked | given | refused
    given: int = 0
    reason: str = ""
    took_s: float = 0.0
    kind: str = "give"  # give: bytes above its floor; sleep: its whole share, by falling asleep


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat from its state on (field 3); [] where /proc does not say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return []


def process_start(pid: int) -> str:
    """When `pid` started (field 22 of /proc/PID/stat); "" where /proc does not say."""
    stat = _stat(pid)
    return stat[19] if len(stat) > 19 else ""


def started_at(started: str) -> str | None:
    """A process start time as /proc gives it (clock ticks since the boot) as an ISO time; None unknown."""
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        at = boot + int(started) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at))


def _shown(member: Member) -> dict[str, Any]:
    """A member as /wrapper/memory and `plan --pool` show it: `started` as a time (the record keeps /proc's
    ticks, which tell a reused pid apart)."""
    return {**asdict(member), "name": member.name, "started": started_at(member.started)}


def alive(pid: int, started: str) -> bool:
    """The member's process runs: it exists, is no zombie (killed, not yet reaped), and is the one that wrote
    the record (a pid used again names another start time)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    stat = _stat(pid)
    if stat and stat[0] in ("Z", "X"):
        return False
    return not started or not stat or stat[19] == started


def _write(path: Path, data: dict[str, Any]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(data))
    os.replace(temporary, path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _of(kind: type[Any], data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(kind)}
    return kind(**{k: v for k, v in data.items() if k in names})


def _sound(member: Member) -> bool:
    """A record as a member writes it: a process id, and a share and floor in bytes."""
    numbers = (member.pid, member.share, member.floor)
    return all(isinstance(n, int) and not isinstance(n, bool) for n in numbers) and member.pid > 0 \
        and member.share >= 0 and member.floor >= 0


def agree(directory: Path, found: dict[str, Any], total: int, device: str, explicit: bool) -> None:
    """PoolError unless a member planning for `device` with `total` bytes (its own budget when `explicit`, else
    `auto`) may join the pool `found` describes."""
    if found.get("device") != device:
        raise PoolError(f"degrade.pool {directory} is memory of the {found.get('device')}, and this member plans "
                        f"for the {device}: members of one pool share one device (the GPU with -ngl, else the "
                        "host); give this member a pool of its own device")
    if explicit and int(found["total"]) != total:
        raise PoolError(f"degrade.pool {directory} holds {format_size(int(found['total']))} "
                        f"({found.get('source')}), and this member's degrade.budget is {format_size(total)}: "
                        "write the same budget for every member (or `auto` to take the pool's), or remove "
                        "the folder while no member runs to make the pool again")


class Pool:
    """The folder; `locked()` gives a `Locked` pool to read and change."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    @contextlib.contextmanager
    def locked(self) -> Iterator[Locked]:
        try:
            for sub in ("members", "asks"):
                (self.dir / sub).mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise PoolError(f"degrade.pool {self.dir}: cannot use the folder ({exc.strerror}): give a folder "
                            "every member can write, e.g. /run/llama-wrapper/gpu0") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield Locked(self.dir)
        finally:
            os.close(fd)  # releases the lock


class Locked:
    """The pool while its lock is held: read it, change it, never wait in it."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.gone: list[Member] = []  # members found dead by this holder (and removed)

    # -- the pool itself ------------------------------------------------------------------------------------

    def made(self) -> dict[str, Any] | None:
        """pool.json as its first member wrote it; None when there is none yet. PoolError when it is damaged or
        of another version: it is never written over (its members would no longer agree)."""
        path = self.dir / "pool.json"
        if not path.exists():
            return None
        found = _read(path)
        if found is None:
            raise PoolError(f"degrade.pool {self.dir}: pool.json is damaged (not the JSON a member writes): stop "
                            "the pool's members and remove the folder, or give this member another one")
        if found.get("format") != FORMAT or found.get("version") != VERSION:
            raise PoolError(f"degrade.pool {self.dir} was made by another version of llama-wrapper (format "
                            f"{found.get('format')!r} version {found.get('version')!r}, this one reads version "
                            f"{VERSION}): stop its members and remove the folder, or give this member another one")
        total, device = found.get("total"), found.get("device")
        sound = isinstance(total, int) and not isinstance(total, bool) and total > 0
        if not sound or not isinstance(device, str) or not device:
            raise PoolError(f"degrade.pool {self.dir}: pool.json is damaged (total {total!r}, device {device!r}): "
                            "stop the pool's members and remove the folder, or give this member another one")
        return found

    def join(self, total: int, source: str, device: str, explicit: bool) -> dict[str, Any]:
        """The pool as made by its first member, or made now with `total` bytes on `device`. A member whose own
        budget was given (`explicit`) must agree with the pool's total; one with `auto` takes it."""
        found = self.made()
        if found is None:
            found = {"format": FORMAT, "version": VERSION, "total": total, "source": source, "device": device,
                     "created": time.time()}
            _write(self.dir / "pool.json", found)
            return found
        agree(self.dir, found, total, device, explicit)
        return found

    @property
    def total(self) -> int:
        found = self.made()
        return int(found["total"]) if found else 0

    # -- members --------------------------------------------------------------------------------------------

    def members(self) -> list[Member]:
        """The living members; the dead ones' records and asks are removed."""
        living = []
        for path in sorted((self.dir / "members").glob("*.json")):
            data = _read(path)
            try:
                member = _of(Member, data) if data is not None else None
            except TypeError:
                member = None
            if member is not None and not _sound(member):
                member = None
            if member is None:
                with contextlib.suppress(OSError):
                    path.unlink()  # unreadable: written by nobody we know
                continue
            if alive(member.pid, member.started):
                living.append(member)
                continue
            self.gone.append(member)
            with contextlib.suppress(OSError):
                path.unlink()
            for ask in self.asks():
                if member.pid in (ask.asker, ask.giver):
                    self.drop_ask(ask.id)
        return living

    def member(self, pid: int) -> Member | None:
        return next((m for m in self.members() if m.pid == pid), None)

    def used_by_others(self, pid: int) -> int:
        return sum(m.share for m in self.members() if m.pid != pid)

    def free(self, pid: int | None = None) -> int:
        """What is not shared out: to `pid`, its own share counts as free."""
        return self.total - sum(m.share for m in self.members() if m.pid != pid)

    def put(self, member: Member) -> None:
        if not member.started:
            member.started = process_start(member.pid)
        member.at = time.time()
        _write(self.dir / "members" / f"{member.pid}.json", asdict(member))

    def leave(self, pid: int) -> None:
        with contextlib.suppress(OSError):
            (self.dir / "members" / f"{pid}.json").unlink()
        for ask in self.asks():
            if ask.asker == pid:
                self.drop_ask(ask.id)

    # -- asks -----------------------------------------------------------------------------------------------

    def asks(self) -> list[Request]:
        found = []
        for path in sorted((self.dir / "asks").glob("*.json")):
            data = _read(path)
            with contextlib.suppress(TypeError):
                if data is not None:
                    found.append(_of(Request, data))
        return found

    def ask(self, asker: Member, giver: Member, nbytes: int, kind: str = "give") -> Request:
        made = Request(uuid.uuid4().hex[:12], asker.pid, asker.model, giver.pid, nbytes, kind=kind)
        self.write_ask(made)
        return made

    def write_ask(self, ask: Request) -> None:
        _write(self.dir / "asks" / f"{ask.id}.json", asdict(ask))

    def drop_ask(self, ask_id: str) -> None:
        with contextlib.suppress(OSError):
            (self.dir / "asks" / f"{ask_id}.json").unlink()

    # -- moves ----------------------------------------------------------------------------------------------

    def moved(self, move: dict[str, Any]) -> None:
        path = self.dir / "moves.jsonl"
        kept = self.moves(MOVES_KEPT - 1)
        lines = [json.dumps(m) for m in [*kept, move]]
        temporary = path.with_name(f".moves.{os.getpid()}.tmp")
        temporary.write_text("\n".join(lines) + "\n")
        os.replace(temporary, path)

    def moves(self, last: int = 20) -> list[dict[str, Any]]:
        try:
            lines = (self.dir / "moves.jsonl").read_text().splitlines()
        except OSError:
            return []
        found = []
        for line in lines[-last:] if last else []:
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def summary(self) -> dict[str, Any]:
        """The pool for /wrapper/memory and `plan --pool`."""
        made = self.made() or {}
        members = self.members()
        used = sum(m.share for m in members)
        return {"dir": str(self.dir), "total": made.get("total"), "source": made.get("source"),
                "device": made.get("device"), "used": used,
                "free": (int(made["total"]) - used) if made else None,
                "members": [_shown(m) for m in members], "moves": self.moves()}
