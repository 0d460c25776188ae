"""The store as a folder: the model's slot folder (llama-server's --slot-save-path, so that it restores an entry
by its plain name), shared by every host pointed at it (NFS, a ReadWriteMany volume).

An entry is a pair committed as hooks/store/layout.py commits one: `conv-<key>-<fingerprint>.bin`, the state
llama-server wrote (its token ids first), and the sidecar `conv-<key>.json` that names it, written last. With
`chunk_tokens`, the state is cut into chunks (hooks/store/chunks.py) written once into `chunks/`
(hooks/store/chunk_folder.py) before the sidecar — the manifest — names them, and the pair's file is only the tail;
a restore assembles the state into a part file in the slot folder, which is removed once llama-server has read it.
The key is a hash of the entry's tokens: two hosts that save the same state write the same key, each its own KV
file, and the last sidecar wins; a reader only ever follows a committed sidecar to a whole file, and a half-written
part has a name no reader looks at. The listing is kept and done again when the folder's mtime changes (a commit or
a removal by any host) or once it is RELIST_S old (NFS caches attributes). The sidecar's mtime is the entry's last
use.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from hooks import kvfile
from hooks.store import chunks, layout
from hooks.store.chunk_folder import ChunkFolder, names_of, plan_problem, size_of
from hooks.store.interface import (
    Entry,
    Forgotten,
    Noted,
    Shares,
    Unreadable,
    best_of,
    common_prefix,
    held_within,
    key_of,
    owner_of,
)
from wrapper.configuration.consumers import name_of, share_for

T = TypeVar("T")
PREFIX = layout.ENTRY_PREFIX
RELIST_S = 30.0
PART_AGE_S = 3600.0  # another host's part this old is litter (a writer that died)
ORPHAN_AGE_S = 60.0
_SIDECAR = re.compile(r"^conv-([0-9a-f]{16})\.json$")
_KV_FILE = re.compile(r"^conv-([0-9a-f]{16})-[0-9a-f]{12}\.bin$")
_PART = re.compile(r"^conv-[A-Za-z0-9]+\.bin\.part-([A-Za-z0-9]+)-(\d+)$")  # being written by host, pid
_parts = itertools.count()
_OURS = ("chunks", "tail_bytes", "host", "token_ids", "keyed_names")  # what a commit writes anew, never copied
_SALTED = ("cache_type_k", "cache_type_v", "flash_attn", "swa_full", "attn_rot_disable", "state_version", "build")


def _mark(names: str) -> str:
    """A one-way mark of the key entry and chunk names are hashed with, kept in each sidecar (`keyed_names`)."""
    return hashlib.sha256(b"llama-wrapper names\0" + names.encode()).hexdigest()[:12]


def _salt(record: dict[str, Any], names: str | None) -> str:
    """What a chunk's name is chained over beside its layout: the model and what else decides its KV bytes; a private
    entry's consumer (its chunks are its alone: forgotten with it, never shared); the store's name key, for an entry
    committed with one (store.encrypt: `keyed_names`)."""
    owner = owner_of(record)
    keyed = names if record.get("keyed_names") else None
    return json.dumps([(record.get("model") or {}).get("id"), *(record.get(k) for k in _SALTED),
                       *([owner] if owner is not None else []), *([keyed] if keyed is not None else [])])


def part_name(what: str) -> str:
    """Where llama-server writes a state before it is committed: host, pid and a count keep writers apart."""
    label = re.sub(r"[^A-Za-z0-9]", "", what)[:24] or "state"
    return f"{PREFIX}{label}{next(_parts)}.bin.part-{layout.host_id()}-{os.getpid()}"


def _locked(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def under_lock(self: DirectoryStore, *args: Any, **kwargs: Any) -> T:
        with self._lock:
            return method(self, *args, **kwargs)
    return under_lock


class DirectoryStore:
    def __init__(self, directory: Path, relist_s: float = RELIST_S,
                 clock: Callable[[], float] = time.monotonic, chunk_tokens: int = 0, names: str | None = None) -> None:
        self.directory = directory
        self.names = names  # the key entry and chunk names are hashed with (store.encrypt), None: plain hashes
        self.chunk_tokens = chunk_tokens  # 0: each state kept whole
        self.chunks = ChunkFolder(directory)
        self._lock = threading.RLock()  # the listing, against a commit on a worker thread
        self._foreign: dict[str, set[str]] = {}  # chunks named by manifests this reader cannot use
        self._relist_s, self._clock = relist_s, clock
        self._index: dict[str, Entry] = {}
        self._files: dict[str, tuple[Path, Path]] = {}  # key -> sidecar, KV file
        self._legacy_entries: dict[str, Entry] = {}  # pairs of the earlier layout, by `slot<N>`: not in lookups
        self._seen: tuple[float, float] | None = None  # the folder's mtime and when it was listed
        self.forgotten_at: dict[str, float] = {}  # consumer -> when what it kept was forgotten
        self._cut_off: dict[str, float] = {}  # consumer -> a state of its taken before then is never committed

    # -- lookups ---------------------------------------------------------------------------------------------

    @_locked
    def entries(self) -> list[Entry]:
        return list(self._look().values())

    @_locked
    def get(self, key: str) -> Entry | None:
        if key in self._legacy_entries:
            return self._legacy_entries[key]
        sidecar = layout.entry_sidecar(self.directory, key)
        if not sidecar.exists():
            self._forget(key)
            return None
        found = self._read(sidecar, key)
        if found is not None:
            return found
        problem = self._why_unusable(sidecar)
        return Entry(key, 0, 0, 0.0, {}, sidecar.name, True, _unreadable(f"{sidecar.name}: {problem}"),
                     problem=problem)

    def best(self, tokens: list[int]) -> tuple[Entry | None, int]:
        return best_of(self.entries(), tokens)

    def key_for(self, tokens: list[int], owner: str | None = None) -> str:
        """The key an entry of these tokens is committed under here."""
        return key_of(tokens, owner, self.names)

    def find(self, tokens: list[int], owner: str | None = None) -> Entry | None:
        found = self._look().get(self.key_for(tokens, owner))
        return found if found is not None and found.n_tokens == len(tokens) else None

    def held(self, host: str) -> list[Noted]:
        found = {saved.slot: self._legacy(saved) for saved in layout.legacy_slots(self.directory)}
        _, noted = layout.note_of(self.directory, host)
        for slot, each in noted.items():
            found[slot] = Noted(slot, each.key, each.n_tokens, self.get(each.key))
        return [found[slot] for slot in sorted(found)]

    # -- writes ----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def part(self, what: str) -> Iterator[Path]:
        path = self.directory / part_name(what)
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                path.unlink()

    def commit(self, written: Path, tokens: list[int], record: dict[str, Any]) -> Entry:
        """Safe on a worker thread: the cutting and writing take no lock, the listing's update does."""
        key = self.key_for(tokens, owner_of(record))
        sidecar = layout.entry_sidecar(self.directory, key)
        previous = None
        with contextlib.suppress(OSError, layout.SidecarError):
            previous = self._kv_file(sidecar, layout.read_sidecar(sidecar))
        record = {"key": key, "tokens": len(tokens), **{k: v for k, v in record.items() if k not in _OURS},
                  **({"keyed_names": _mark(self.names)} if self.names is not None else {})}
        data, size = kvfile.open_map(written)
        try:
            cut = chunks.split(data, self.chunk_tokens, _salt(record, self.names)) if self.chunk_tokens > 0 \
                else chunks.Split(b"", [], None)
            with self.part("tail") as tail:
                wrote = self.chunks.write(cut)
                if cut.plan is not None:
                    record["chunks"] = cut.plan
                    tail.write_bytes(cut.tail)
                final = layout.commit_pair(self.directory, f"{PREFIX}{key}", tail if cut.plan else written,
                                            record, previous, size if cut.plan else None)
            wrote += self.chunks.rewrite_missing(cut)  # another host's eviction found them unnamed meanwhile
        finally:
            if isinstance(data, mmap.mmap):
                data.close()
        if cut.plan is not None:
            with contextlib.suppress(OSError):
                written.unlink()  # cut: gone before its pages need writing out
        with self._lock:
            forgotten = self._taken_before_forget(record)
            self._forget(key)  # a sidecar rewritten within the mtime's granularity must not pass for the old one
            if forgotten is not None:  # the forget may have removed it already
                for path in (sidecar, final):  # the sidecar first: nothing names a half-removed pair
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                self.chunks.remove(set(names_of(record)), self._named(), min_age=0.0)  # what another names stays
                raise Forgotten(f"{forgotten}'s conversations were forgotten after this state was taken from its "
                                "slot: it is not kept")
            entry = self._read(sidecar, key, tokens)
            if entry is None:  # a longer state of the same conversation was committed meanwhile and replaced it
                return self._holding(tokens, wrote)
            entry.written = wrote + final.stat().st_size + sidecar.stat().st_size
            for other in self.entries():
                with contextlib.suppress(Unreadable):
                    if other.key != key and other.n_tokens < len(tokens) and \
                            common_prefix(other.tokens, tokens) == other.n_tokens:
                        self.remove(other)  # a shorter state of the same conversation: the new one holds it all
        return entry

    def _taken_before_forget(self, record: dict[str, Any]) -> str | None:
        """The consumer a state's record names when it was taken (`saved_at`) before that consumer was forgotten
        (under the lock: a forget sets its time before it lists what it removes); None: it may be kept."""
        consumer = record.get("consumer")
        if not isinstance(consumer, str):
            return None
        named = name_of(consumer)
        cut_off = self._cut_off.get(named)
        return named if cut_off is not None and float(record.get("saved_at") or 0.0) <= cut_off else None

    def _other_key(self, record: dict[str, Any]) -> bool:
        """An entry whose names were hashed with another key than this store's (a folder from before `slots rekey`):
        its chunks cannot be checked, and the bucket sealed with this key must not be sent it. (A store that reads
        the folder without a key — `slots ls` — lists every entry.)"""
        keyed = record.get("keyed_names")
        return self.names is not None and isinstance(keyed, str) and keyed != _mark(self.names)

    def _holding(self, tokens: list[int], wrote: int) -> Entry:
        """The entry that holds `tokens` and more (under the lock), its `written` what this commit wrote."""
        for other in self.entries():
            with contextlib.suppress(Unreadable):
                if other.n_tokens >= len(tokens) and common_prefix(other.tokens, tokens) == len(tokens):
                    other.written = wrote
                    return other
        raise Unreadable(f"the state of {len(tokens)} tokens just written is gone from {self.directory}")

    @_locked
    def touch(self, entry: Entry) -> None:
        sidecar, _ = self._files.get(entry.key, (layout.entry_sidecar(self.directory, entry.key), None))
        with contextlib.suppress(OSError):
            os.utime(sidecar)
            entry.last_used = sidecar.stat().st_mtime

    @_locked
    def remove(self, entry: Entry) -> None:
        self._remove(entry)

    def _remove(self, entry: Entry) -> int:
        """Remove the entry and the chunks no other entry names; the bytes that freed."""
        sidecar, kv_file = self._where(entry)
        freed = int(entry.record.get("tail_bytes", entry.bytes))
        for path in (sidecar, kv_file):  # the sidecar first: nothing names a half-removed pair
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._forget(entry.key)
        if names := names_of(entry.record):  # what another entry names stays
            # a chunk another process touched since this entry's last use may be named by its commit in
            # progress: it goes at the sweep, if nothing names it by then
            freed += len(self.chunks.remove(names, self._named(), since=entry.last_used)) * size_of(entry.record)
        return freed

    @_locked
    def forget(self, consumer: str, before: float | None = None) -> list[Entry]:
        """Remove every entry of that consumer (of every `cache_salt`; saved before `before`, when given), the chunks
        no other entry names at once, and the notes' lines naming them; what went. A save of its taken before then
        that commits later is refused (`Forgotten`)."""
        at = time.time() if before is None else before
        self._cut_off[consumer] = max(at, self._cut_off.get(consumer, at))
        gone = [e for e in self.entries() if e.named == consumer and (
            before is None or float(e.record.get("saved_at") or 0.0) <= before)]
        names: set[str] = set()
        for entry in gone:
            sidecar, kv_file = self._where(entry)
            for path in (sidecar, kv_file):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            self._forget(entry.key)
            names.update(names_of(entry.record))
        self.chunks.remove(names, self._named(), min_age=0.0)
        layout.drop_from_notes(self.directory, {e.key for e in gone})
        self._seen = None
        return gone

    @_locked
    def evict(self, budget: int, keep: set[str] | None = None, shares: Shares | None = None) -> list[Entry]:
        removed = []
        bounded = shares.folder if shares is not None else {}
        if bounded:  # a consumer over its share loses its own oldest first
            self._seen = None
            for entry in held_within(self.entries(), bounded, keep or set()):
                self._remove(entry)
                removed.append(entry)
        if self.used_bytes() <= budget:
            return removed
        self._seen = None  # other hosts' hits moved their last use: look again before removing anything
        self.chunks.remove(self._on_disk(), self._named())  # chunks no manifest names go first
        used = self.used_bytes()
        # then the least recently used, those of a consumer within its share last
        for entry in sorted(self.entries(), key=lambda e: (share_for(bounded, e.named) is not None, e.last_used)):
            if used <= budget:
                break
            if keep and entry.key in keep:
                continue
            used -= self._remove(entry)
            removed.append(entry)
        return removed

    def in_tiers(self) -> tuple[set[str], set[str]]:
        return {e.key for e in self.entries()}, set()

    async def forget_consumer(self, consumer: str) -> dict[str, Any]:
        gone = await asyncio.to_thread(self.forget, consumer)
        self.forgotten_at[consumer] = time.time()
        return {"folder": {"entries": len(gone), "bytes": sum(e.bytes for e in gone)}, "bucket": None}

    def forgotten(self) -> dict[str, float]:
        return dict(self.forgotten_at)

    def used_bytes(self) -> int:
        """What the entries take on disk: their files, and each chunk once."""
        return sum(int(e.record.get("tail_bytes", e.bytes)) for e in self.entries()) + self.chunks.bytes()

    def _named(self) -> set[str]:
        named = {name for e in self.entries() for name in names_of(e.record)}
        return named.union(*self._foreign.values())

    def _on_disk(self) -> list[str]:
        folder = self.chunks.directory
        return [p.name[:-3] for p in folder.glob("*.kv")] if folder.is_dir() else []

    @_locked
    def set_aside(self, entry: Entry, reason: str) -> str:
        sidecar, kv_file = self._where(entry)
        folder = layout.set_aside(sidecar, kv_file, reason)
        self._forget(entry.key)
        return str(folder)

    def note(self, host: str, slots: dict[int, Entry]) -> bool:
        path, noted = layout.note_of(self.directory, host)
        merged = {**noted, **{slot: layout.NoteLine(slot, e.key, e.n_tokens) for slot, e in slots.items()}}
        superseded = {slot for slot in slots if slot in {s.slot for s in layout.legacy_slots(self.directory)}}
        if merged == noted and path is not None and path.name == f"held-{host}.json" and not superseded:
            return False
        layout.write_note(self.directory, host, merged)
        layout.remove_legacy(self.directory, superseded)  # after the note: the slot's state is named there
        return True

    # -- the tiers: nothing behind the folder --------------------------------------------------------------

    @property
    def behind(self) -> str | None:
        return None

    def where(self, entry: Entry) -> str:
        return "local" if self.get(entry.key) is not None else "gone"

    async def first_look(self, within: float) -> None:
        return None

    async def background(self) -> None:
        return None

    async def flush(self, budget_s: float) -> dict[str, Any] | None:
        return None

    def status(self) -> dict[str, Any] | None:
        return None

    def metrics(self) -> None:
        return None

    # -- making an entry readable by llama-server ------------------------------------------------------------

    async def fetch(self, entry: Entry) -> Entry:
        return entry  # on local disk (or a mounted share) already

    @contextlib.asynccontextmanager
    async def local(self, entry: Entry) -> AsyncIterator[Path]:
        if entry.problem is not None:
            raise Unreadable(f"no usable sidecar: {entry.problem}")
        record, kv_file = self._checked(entry)
        if not names_of(record):
            yield kv_file
            return
        with self.part("restore") as state:  # in the page cache: removed once restored
            await asyncio.to_thread(self.chunks.assemble, kv_file, record, state, _salt(record, self.names))
            yield state

    def write_state(self, entry: Entry, into: Path) -> None:
        """The entry's whole state file (its chunks and its tail put together, checked) written at `into`."""
        if entry.problem is not None:
            raise Unreadable(f"no usable sidecar: {entry.problem}")
        record, kv_file = self._checked(entry)
        if names_of(record):
            self.chunks.assemble(kv_file, record, into, _salt(record, self.names))
        else:
            shutil.copyfile(kv_file, into)

    def _checked(self, entry: Entry) -> tuple[dict[str, Any], Path]:
        """The entry's sidecar as it is now, and the file it names, once they are checked against each other
        (the file a sidecar names, never one beside or outside the folder); Unreadable with the cause."""
        sidecar, _ = self._where(entry)
        try:
            record = layout.read_sidecar(sidecar)
            kv_file = self._kv_file(sidecar, record) if entry.by_content else self._where(entry)[1]
            if problem := plan_problem(record):
                raise layout.SidecarError(f"{sidecar.name} has {problem}")
        except layout.SidecarError as exc:
            raise Unreadable(f"no usable sidecar: {exc}") from exc
        try:
            layout.check_pair(record, kv_file)
        except layout.SidecarError as exc:  # the sidecar is sound: the file it names is not what was saved
            raise Unreadable(f"its state file is damaged or incomplete: {exc}") from exc
        return record, kv_file

    def problem(self, entry: Entry) -> str | None:
        if entry.problem is not None:
            return entry.problem
        try:
            record, kv_file = self._checked(entry)
            if not (names := names_of(record)):
                return None
            size = size_of(record)
            missing = [n for n in names if not self.chunks.has(n, size)]
            if missing:
                return f"{len(missing)} of its {len(names)} chunks missing or cut (the first: {missing[0]})"
            data, _ = kvfile.open_map(kv_file)
            try:
                tokens = kvfile.header(data, str(kv_file)).tokens
            finally:
                if isinstance(data, mmap.mmap):
                    data.close()
            named = chunks.names_for(_salt(record, self.names), record["chunks"], tokens)
        except Unreadable as exc:
            return str(exc)
        except (OSError, kvfile.SlotFileError) as exc:
            return f"its tail: {exc}"
        return None if named == names else "its chunk names are not its tokens' (not this conversation's state)"

    def _why_unusable(self, sidecar: Path) -> str:
        """Why the sidecar of an entry yields no entry: what `get` says of it."""
        try:
            record = layout.read_sidecar(sidecar)
            self._kv_file(sidecar, record)
        except layout.SidecarError as exc:
            return str(exc)
        return f"{sidecar.name} has {plan_problem(record) or 'no usable token count or size'}"

    def fetch_seconds(self, entry: Entry) -> float:
        return 0.0  # on local disk (or a mounted share) already

    def free_bytes(self) -> int:
        try:
            return shutil.disk_usage(self.directory).free
        except OSError:
            return 0

    @_locked
    def sweep(self, now: float | None = None) -> list[str]:
        """Parts of dead writers on this host (or of any host, once an hour old), KV files no sidecar names,
        and what dead saves of the earlier layout left."""
        if not self.directory.is_dir():
            return []
        now = time.time() if now is None else now
        self._seen = None
        named = {self._where(e)[1].name for e in self.entries()}
        host = layout.host_id()
        removed = layout.sweep(self.directory, now) + self.chunks.sweep(self._named(), now)
        for path in self.directory.iterdir():
            part = _PART.match(path.name)
            age = layout.age(path, now)
            if part:
                pid = int(part.group(2))
                litter = (part.group(1) == host and pid != os.getpid() and not layout.alive(pid)) or age > PART_AGE_S
            else:
                litter = bool(_KV_FILE.match(path.name)) and path.name not in named and age > ORPHAN_AGE_S
            if litter:
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed.append(path.name)
        return removed

    # -- the listing -----------------------------------------------------------------------------------------

    @_locked
    def _look(self) -> dict[str, Entry]:
        try:
            mtime = self.directory.stat().st_mtime
        except OSError:
            return {}
        now = self._clock()
        if self._seen is not None and self._seen[0] == mtime and now - self._seen[1] < self._relist_s:
            return self._index
        self._seen = (mtime, now)  # taken before the listing: a change during it is seen at the next look
        self._foreign = {}
        found = {}
        for path in self.directory.glob(f"{PREFIX}*.json"):
            match = _SIDECAR.match(path.name)
            if match and (entry := self._read(path, match.group(1))) is not None:
                found[entry.key] = entry
        for key in set(self._index) - set(found):
            self._forget(key)  # removed by another host
        return self._index

    def _read(self, sidecar: Path, key: str, tokens: list[int] | None = None) -> Entry | None:
        """The entry a sidecar describes, kept from the last look when neither it nor its KV file changed."""
        try:
            mtime = sidecar.stat().st_mtime
            known = self._index.get(key)
            if known is not None and known.last_used == mtime and self._files[key][0] == sidecar:
                return known
            record = layout.read_sidecar(sidecar)
            kv_file = self._kv_file(sidecar, record)
        except (OSError, layout.SidecarError, ValueError, TypeError):
            return None
        if tokens is None and known is not None and self._files[key][1] == kv_file:
            tokens = known._tokens  # the same file: its tokens are known
        try:
            if plan_problem(record) is not None or self._other_key(record):  # damaged, of another version, named
                # with another key (a folder from before `slots rekey`): never offered, but what it
                names = (record.get("chunks") or {}).get("names") if isinstance(record.get("chunks"), dict) else []
                self._foreign[key] = {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()
                return None  # names is not removed under it
            entry = Entry(key, int(record.get("tokens") or 0), int(record.get("bytes") or 0), mtime, record,
                          kv_file.name, True, _tokens_of(kv_file), tokens)
        except (TypeError, ValueError):
            return None
        self._index[key], self._files[key] = entry, (sidecar, kv_file)
        return entry

    def _legacy(self, saved: layout.SavedSlot) -> Noted:
        """A slot's pair of the earlier layout, as an entry of its own (named by its slot: it is not in lookups)."""
        key = f"slot{saved.slot}"
        try:
            record = layout.read_sidecar(saved.sidecar)
        except layout.SidecarError:
            record = {}
        entry = Entry(key, int(record.get("tokens") or 0), int(record.get("bytes") or 0), 0.0, record,
                      saved.kv_file.name, False, _tokens_of(saved.kv_file))
        self._files[key], self._legacy_entries[key] = (saved.sidecar, saved.kv_file), entry
        return Noted(saved.slot, key, entry.n_tokens, entry)

    def _where(self, entry: Entry) -> tuple[Path, Path]:
        if entry.key in self._files:
            return self._files[entry.key]
        sidecar = layout.entry_sidecar(self.directory, entry.key)
        return sidecar, self.directory / entry.name

    def _forget(self, key: str) -> None:
        self._index.pop(key, None)
        self._files.pop(key, None)
        self._legacy_entries.pop(key, None)

    def _kv_file(self, sidecar: Path, record: dict[str, Any]) -> Path:
        name = record.get("file")
        if not isinstance(name, str) or not _KV_FILE.match(name):
            raise layout.SidecarError(f"{sidecar.name} names an odd file: {name!r}")
        return sidecar.parent / name


def _tokens_of(kv_file: Path) -> Callable[[], list[int]]:
    def load() -> list[int]:
        try:
            data, _ = kvfile.open_map(kv_file)
            try:
                return kvfile.header(data, str(kv_file)).tokens
            finally:
                if isinstance(data, mmap.mmap):
                    data.close()
        except (OSError, kvfile.SlotFileError) as exc:
            raise Unreadable(f"{kv_file.name}: {exc}") from exc
    return load


def _unreadable(name: str) -> Callable[[], list[int]]:
    def load() -> list[int]:
        raise Unreadable(f"{name} cannot be read")
    return load
