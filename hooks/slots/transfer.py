"""A slot saved into the store, an entry restored into a slot: one way each, used at a start, a stop, a reload
and before a request, so that each fails the same way wherever it runs, and what a restore would cost (`cost_of`:
what the restore-or-prefill rule needs). A server that dies under a restore is noticed there: the entry is set
aside (it would kill the next start too) and ServerLost is raised."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import structlog

from hooks import kvfile
from hooks.kvfile import convert as kvconvert
from hooks.slots.book import book_of
from hooks.slots.restorable import WARMABLE, Mismatch, Skip, server_layout, skip_reason
from hooks.store import Entry, Forgotten, Store, Unavailable, Unreadable, owner_of
from wrapper.configuration import consumers
from wrapper.configuration.consumers import CONSUMERS
from wrapper.kept import Key
from wrapper.progress import PROGRESS
from wrapper.server.generation import Generation, ServerLost
from wrapper.server.llama import LlamaError

log = structlog.get_logger()
T = TypeVar("T")

_LOG_HINT = re.compile(r"error|fail|mismatch|incompatible|invalid|unknown", re.IGNORECASE)
_DERIVED = ("format", "slot", "key", "tokens", "file", "bytes", "fingerprint", "tail_bytes", "chunks", "host")
# a commit writes these anew
_LAYOUT = ("cache_type_k", "cache_type_v", "flash_attn", "swa_full", "kv_unified", "kv_streams", "total_slots",
           "n_ctx", "attn_rot_disable", "build")

_SERVER: Key[dict[str, Any]] = Key("slots.server", dict)  # the running server's layout settings


async def server_layout_of(generation: Generation) -> dict[str, Any]:
    """The running server's settings that decide a state file's layout (asked once per generation)."""
    found = generation.state.get(_SERVER)
    if not found:
        props = await generation.props()
        found.update(server_layout(generation.launch.argv, generation.launch.env, props, generation.launch.facts))
    return found


def owned(generation: Generation, owner: str | None) -> dict[str, Any]:
    """What an entry's record says of whose it is: its consumer (when consumers are configured and the slot's is
    known), private to it under `consumers.isolate` (its key and chunks named with it: hooks/store/interface.py)."""
    if not owner:  # not known, or cut down to the public beginning
        return {}
    if consumers.is_salted(owner):  # a request's cache_salt: private whatever the config says
        return {"consumer": owner, "private": True}
    settings = CONSUMERS.of(generation.config)
    if not consumers.on(settings):
        return {}
    return {"consumer": owner, **({"private": True} if consumers.isolating(settings) else {})}


def record_for(settings: dict[str, Any], header: kvfile.SlotFile, generation: Generation,
               taken: float | None = None) -> dict[str, Any]:
    """What an entry's sidecar says of the state beside its tokens: the model and the KV layout it needs; `saved_at`:
    when the state was taken from its slot (`taken`, the wall clock; now when not given)."""
    return {"model": generation.launch.model.as_dict(), "state_version": header.version,
            **{k: settings[k] for k in _LAYOUT}, "media": header.n_media,
            "saved_at": time.time() if taken is None else taken}


@dataclass(frozen=True)
class Cost:
    """What bringing an entry back into a slot costs, as the restore-or-prefill rule needs it."""

    bytes: int
    converts: bool  # converted first (other cache types, an earlier state version)
    fetch_s: float  # before it is on local disk (the tier behind the folder)


async def cost_of(generation: Generation, store: Store, entry: Entry) -> Cost:
    settings = await server_layout_of(generation)
    return Cost(entry.bytes, converts(entry.record, settings, book_of(generation).state_version),
                store.fetch_seconds(entry))


def converts(record: dict[str, Any], settings: dict[str, Any], state_version: int | None) -> bool:
    """Whether a restore of an entry with this sidecar record goes through a conversion: the prediction of what
    `restore_into` finds in the file (the state version first, then the cache types, as `skip_reason` checks)."""
    version = record.get("state_version")
    if state_version is not None and isinstance(version, int) and version != state_version:
        return _upgrades(version, state_version)
    if (record.get("cache_type_k"), record.get("cache_type_v")) != (settings["cache_type_k"], settings["cache_type_v"]):
        return _rewrites(version if isinstance(version, int) else None, state_version)
    return False


def _rewrites(file_version: int | None, state_version: int | None) -> bool:
    """A conversion to other cache types writes kvconvert.WRITES: only for a server that reads it."""
    return state_version == kvconvert.WRITES or (state_version is None and file_version == kvconvert.WRITES)


def _upgrades(file_version: int, state_version: int | None) -> bool:
    return state_version == kvconvert.WRITES and file_version in kvfile.READS and file_version < kvconvert.WRITES


# -- save ---------------------------------------------------------------------------------------------------


class NotSaved(Exception):
    """Why a slot's state was not kept; `failed`: an error, not a choice."""

    def __init__(self, reason: str, failed: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.failed = reason, failed


@dataclass(frozen=True)
class Saved:
    entry: Entry
    new: bool  # False: the store held that state already, nothing was written
    server_ms: float | None
    total_ms: float


async def save_into(generation: Generation, store: Store, slot: int, min_tokens: int = 1,
                    max_bytes: int | None = None) -> Saved | None:
    """What the slot holds, as an entry of the store; None when it holds fewer than `min_tokens`. The book is told
    what the slot holds only when nothing changed there while the save ran (a request the server placed itself may
    have run there meanwhile)."""
    book = book_of(generation)
    if book.to_erase(slot):
        raise NotSaved("its consumer was forgotten while a request ran there: it is erased once free, never kept")
    began, taken = time.monotonic(), time.time()
    before = book.changes(slot)
    with store.part(f"slot{slot}") as part:
        try:
            answer = await generation.client.slot_action(slot, "save", part.name)
            if int(answer.get("n_saved", 0)) < max(1, min_tokens):
                if slot in book.untracked() and book.changes(slot) == before:
                    book.unkeepable(slot)  # too little there to keep: not tried again until it serves again
                return None
            header = kvfile.read(part)  # a file we cannot read back never becomes an entry
            book.learnt_version(header.version)
            server_ms = (answer.get("timings") or {}).get("save_ms")
            whose = owned(generation, book.owner_of(slot))
            if (known := store.find(header.tokens, owner_of(whose))) is not None:
                store.touch(known)
                if book.changes(slot) == before:
                    book.saved(slot, header.tokens, known.key)
                return Saved(known, False, server_ms, _ms(began))
            if max_bytes is not None and header.bytes > max_bytes:
                raise NotSaved(f"{header.bytes >> 20} MiB is more than store.entry_max or store.budget")
            record = {**record_for(await server_layout_of(generation), header, generation, taken),
                      "save_ms": server_ms, **whose}
            entry = await _uncancelled(asyncio.to_thread(store.commit, part, header.tokens, record))
        except Forgotten as exc:  # its consumer was forgotten while it was being saved
            raise NotSaved(str(exc)) from exc
        except (LlamaError, kvfile.SlotFileError, Unreadable, OSError) as exc:
            raise NotSaved(f"save failed: {exc}", failed=True) from exc
    if book.changes(slot) == before:
        book.saved(slot, header.tokens, entry.key)
    return Saved(entry, True, server_ms, _ms(began))


# -- restore ------------------------------------------------------------------------------------------------


class NotRestored(Exception):
    """Why an entry was not restored: `failed` when the server refused it, `warmable` when a prefill of its
    tokens makes up for it (another layout of the same model and tokens)."""

    def __init__(self, reason: str, failed: bool = False, kind: Mismatch | None = None,
                 header: kvfile.SlotFile | None = None, conversion: Any = None, damaged: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.failed, self.kind, self.header, self.conversion = reason, failed, kind, header, conversion
        self.damaged = damaged  # unreadable or not what its sidecar says: of no use to any server

    @property
    def warmable(self) -> bool:
        return self.kind in WARMABLE


@dataclass(frozen=True)
class Restored:
    entry: Entry  # what was restored (a converted entry when the cache types differed)
    header: kvfile.SlotFile
    n_restored: int
    server_ms: float | None
    total_ms: float
    conversion: dict[str, Any] | None


async def restore_into(generation: Generation, store: Store, entry: Entry, slot: int) -> Restored:
    """Check the entry against the running server, convert it when only the cache types or another build's
    framing differ, restore it. NotRestored with the reason otherwise; ServerLost (the entry set aside) when the
    server died under it. A converted state replaces the entry only once the server has restored it."""
    settings = await server_layout_of(generation)
    try:
        entry = await store.fetch(entry)
        async with store.local(entry) as path:
            return await _restore_from(generation, store, entry, slot, path, settings)
    except Unreadable as exc:
        raise NotRestored(str(exc), damaged=True) from exc
    except Unavailable as exc:  # not the entry's fault: it stays
        raise NotRestored(str(exc)) from exc


async def _restore_from(generation: Generation, store: Store, entry: Entry, slot: int, path: Path,
                        settings: dict[str, Any]) -> Restored:
    book = book_of(generation)
    try:
        header = kvfile.read(path)
    except kvfile.SlotFileError as exc:
        raise NotRestored(f"unreadable file: {exc}", damaged=True) from exc
    model = generation.launch.model.id
    skip = skip_reason(slot, entry.record, header, model, settings, book.state_version)
    conversion: Any = None
    if skip is not None and convertible(skip, header, book.state_version):
        with store.part("converted") as part:
            try:  # the same tokens in other cache types, or another build's framing of them
                converted, record, conversion = await _convert(generation, entry, path, part, settings, header)
            except (kvconvert.NotConvertible, kvfile.SlotFileError, OSError) as exc:
                conversion = f"not converted: {exc}"
                log.info("slots.not_converted", slot=slot, entry=entry.key, reason=str(exc))
            else:
                described = {**record, "bytes": converted.bytes, "tokens": converted.n_tokens}  # as a commit says
                skip = skip_reason(slot, described, converted, model, settings, book.state_version)
                if skip is None:
                    done = await _restore_file(generation, store, entry, slot, part, converted, conversion)
                    # the server took it: it replaces the old
                    fresh = await _uncancelled(asyncio.to_thread(store.commit, part, converted.tokens, record))
                    if not entry.by_content:
                        store.remove(entry)  # a pair of the earlier layout: the converted entry holds its tokens
                    log.info("slots.converted", entry=fresh.key, **conversion)
                    book.restored(slot, converted.tokens, fresh.key if fresh.by_content else None, fresh.consumer)
                    return replace(done, entry=fresh)
                header = converted
    if skip is not None:
        raise NotRestored(skip.reason, kind=skip.kind, header=header, conversion=conversion)
    done = await _restore_file(generation, store, entry, slot, path, header, conversion)
    book.restored(slot, header.tokens, entry.key if entry.by_content else None, entry.consumer)
    return done


async def _restore_file(generation: Generation, store: Store, entry: Entry, slot: int, path: Path,
                        header: kvfile.SlotFile, conversion: Any) -> Restored:
    """Restore `path` (the entry's file, or a conversion of it) into `slot`; NotRestored when the server refuses
    it, ServerLost (the entry set aside) when the server died under it."""
    child = generation.child
    if child is not None and not child.alive:  # dead before this restore: not this file's doing
        raise ServerLost(f"llama-server was not running when slot {slot} was to be restored from {entry.name}")
    mark = child.lines_seen if child else 0
    began = time.monotonic()
    try:
        answer = await generation.client.slot_action(slot, "restore", path.name)
    except LlamaError as exc:
        said = await _server_says(generation, mark)
        if exc.status is None and generation.child is child and await _died(generation):  # it died under it?
            reason = f"llama-server died restoring it: {exc}{said}"
            where = store.set_aside(entry, reason)
            log.error("slots.set_aside", slot=slot, entry=entry.key, file=entry.name, to=where, reason=reason)
            raise ServerLost(f"llama-server died restoring slot {slot} from {entry.name}; the file was set aside "
                             f"in {where}") from exc
        raise NotRestored(f"the server refused it: {exc}{said}", failed=True, header=header) from exc
    return Restored(entry, header, int(answer.get("n_restored", header.n_tokens)),
                    (answer.get("timings") or {}).get("restore_ms"), _ms(began), conversion)


def convertible(skip: Skip, header: kvfile.SlotFile, state_version: int | None) -> bool:
    """A conversion makes the entry fit: other cache types (into the version the converter writes, which the
    server must read), or an earlier state version (`upgradable`)."""
    if skip.kind is Mismatch.CACHE_TYPES:
        return _rewrites(header.version, state_version)
    return upgradable(skip, header, state_version)


def upgradable(skip: Skip, header: kvfile.SlotFile, state_version: int | None) -> bool:
    """An entry another llama-server build wrote in an earlier state version whose layout converts into the one
    this server reads (b9095's version 2 into b11434's 4)."""
    return skip.kind is Mismatch.STATE_VERSION and header.kv is not None and _upgrades(header.version, state_version)


async def _convert(generation: Generation, entry: Entry, source: Path, part: Path, settings: dict[str, Any],
                   header: kvfile.SlotFile) -> tuple[kvfile.SlotFile, dict[str, Any], dict[str, Any]]:
    """The entry rewritten into `part` in the server's cache types, rotation and state version (in a thread: the
    wrapper goes on answering), checked against the source; its header, sidecar record and what was done."""
    was = f"{entry.record.get('cache_type_k')}/{entry.record.get('cache_type_v')}"
    now = f"{settings['cache_type_k']}/{settings['cache_type_v']}"
    if header.version != kvconvert.WRITES:
        was += f", state version {header.version} (build {entry.record.get('build') or '?'})"
        now += f", state version {kvconvert.WRITES} (build {settings['build']})"
    implied = _implied_rotation(generation, header, bool(entry.record.get("attn_rot_disable")))
    done = await asyncio.to_thread(convert_for, generation, source, part, settings, implied)
    converted = kvfile.read(part)
    if converted.tokens != header.tokens or converted.kv is None or header.kv is None \
            or converted.kv.cells != header.kv.cells or converted.kv.n_layer != header.kv.n_layer:
        raise kvconvert.NotConvertible("the converted state does not hold what the source held")
    record = {**{k: v for k, v in entry.record.items() if k not in _DERIVED},
              "cache_type_k": settings["cache_type_k"], "cache_type_v": settings["cache_type_v"],
              "attn_rot_disable": bool(settings["attn_rot_disable"]), "converted_from": was,
              "state_version": converted.version, "build": settings["build"]}
    conversion = {"from": was, "to": now, "ms": round(done.seconds * 1000, 1), "mb_per_s": round(done.mb_per_s, 1)}
    return converted, record, conversion


def _implied_rotation(generation: Generation, header: kvfile.SlotFile, disabled: bool) -> tuple[int, int]:
    """The K/V rotation a file of an earlier state version holds without saying: its cache types' default."""
    facts = generation.launch.facts
    kv = header.kv
    k_type = kv.k_types[0] if kv and kv.k_types else "f16"
    v_type = kv.v_types[0] if kv and kv.v_types else "f16"
    return (_rotation(k_type, facts.get("head_dim_k"), True, disabled),
            _rotation(v_type, facts.get("head_dim_v"), False, disabled))


def _rotation(type_name: str, head_dim: int | None, for_keys: bool, disabled: bool) -> int:
    """What a server gives a cache of this type; NotConvertible when it depends on a head size not known (a
    model not read from a -m file): a guess would restore a rotated cache as an unrotated one."""
    if not head_dim and not disabled and type_name not in ("f32", "f16", "bf16"):
        raise kvconvert.NotConvertible(f"the model's head size is not known, so the rotation of a {type_name} "
                                       "cache is not either")
    return kvconvert.target_rotation(type_name, head_dim, for_keys, disabled)


def convert_for(generation: Generation, source: Path, target: Path, settings: dict[str, Any],
                implied: tuple[int, int] = (0, 0)) -> kvconvert.Conversion:
    """Rewrite a state file into the running server's cache types, rotation and state version (NotConvertible if
    it cannot); `implied`: the rotation of a source whose state version does not write it."""
    disabled = bool(settings["attn_rot_disable"])
    facts = generation.launch.facts
    rot_k = _rotation(settings["cache_type_k"], facts.get("head_dim_k"), True, disabled)
    rot_v = _rotation(settings["cache_type_v"], facts.get("head_dim_v"), False, disabled)
    return kvconvert.convert(source, target, settings["cache_type_k"], settings["cache_type_v"], rot_k, rot_v,
                             lambda read, size: PROGRESS.update(conversion_mb=f"{read / 1e6:.1f} of {size / 1e6:.1f}"),
                             implied)


async def _uncancelled(work: Awaitable[T]) -> T:
    """A commit on a worker thread, seen through: a cancel (a stop during a reload's save) waits for it to end
    before it goes on, so that the part it reads is not removed under it and what it committed is known."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise


def _ms(began: float) -> float:
    return round((time.monotonic() - began) * 1000, 1)


async def _died(generation: Generation, within: float = 2.0) -> bool:
    """Whether llama-server is gone (a failed request may come just before its exit is seen)."""
    child = generation.child
    if child is None:
        return False
    for _ in range(int(within / 0.05)):  # its exit is seen by polling: the child has no event for it here
        if not child.alive:
            return True
        await asyncio.sleep(0.05)
    return not child.alive


async def _server_says(generation: Generation, mark: int) -> str:
    """The real cause of a failed restore is only in the server's log: wait briefly for it and quote it."""
    child = generation.child
    if child is None:
        return ""
    deadline = time.monotonic() + 0.2
    while True:
        lines = [line for line in child.lines_since(mark) if _LOG_HINT.search(line)]
        if lines:
            return " (server log: " + " | ".join(line.strip() for line in lines[-2:]) + ")"
        if time.monotonic() > deadline:
            return ""
        await asyncio.sleep(0.01)
