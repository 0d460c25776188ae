"""Built-ins `slots.save` and `slots.restore`: slot KV caches kept across restarts, never a good state lost.

A save makes what each slot holds an entry of the store (named by its tokens: hooks/store/interface.py), then writes
this host's note of which entry each slot held; a restore puts back what the note names. Hosts sharing one
slot folder each keep their own note, and every state is an entry any of them can find.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from hooks import kvfile
from hooks.slots.book import book_of
from hooks.slots.book import observer as book_observer
from hooks.slots.restorable import Mismatch
from hooks.slots.reuse import ReuseTracker
from hooks.slots.settings import FAMILY, SLOTS
from hooks.slots.stores import shares_of, store_of
from hooks.slots.transfer import NotRestored, NotSaved, restore_into, save_into, server_layout_of
from hooks.store import Entry, Noted, Store, Unreadable, layout
from hooks.store.settings import STORE
from wrapper.actions import ActionError
from wrapper.configuration import consumers
from wrapper.configuration.consumers import CONSUMERS
from wrapper.kept import Key
from wrapper.metrics import METRICS
from wrapper.progress import PROGRESS
from wrapper.server.generation import Generation, Host, ServerLost
from wrapper.server.llama import LlamaError
from wrapper.steps import Observer

log = structlog.get_logger()

WARM_IDLE_POLL_S = 0.5
FIRST_LOOK_S = 3.0  # a start waits this long at most for the bucket's manifests (then the sync reads them)


@dataclass
class SlotState:
    """What the slot built-ins report of one generation: the last save and restore, and the reuse watch."""

    save: list[dict[str, Any]] = field(default_factory=list)
    restore: list[dict[str, Any]] = field(default_factory=list)
    reuse: ReuseTracker | None = None
    flush: dict[str, Any] | None = None  # the last save's upload of what only the folder held
    restored: asyncio.Event = field(default_factory=asyncio.Event)  # slots.restore has run for this generation

    def tracker(self, generation: Generation) -> ReuseTracker:
        if self.reuse is None:
            self.reuse = ReuseTracker(generation.client)
        return self.reuse


_STATE = Key("slots", SlotState)


def _state(generation: Generation) -> SlotState:
    return generation.state.get(_STATE)


def _store(generation: Generation) -> Store:
    store = store_of(generation)
    if store is None:
        raise ActionError("slot persistence is off: the wrapper did not prepare a slot folder")
    return store


# -- what the registry declares (hooks/registry.py) -------------------------------------------------------


def observer(generation: Generation) -> Observer:
    """What an answer left in its slot (the book), and whether a restored slot's first request reused it."""
    left = book_observer(generation)
    reuse = _state(generation).reuse
    watching = reuse.observer() if reuse is not None else None
    if watching is None:
        return left

    def seen(path: str, status: int, tail: bytes) -> None:
        left(path, status, tail)
        watching(path, status, tail)

    return seen


def status(generation: Generation) -> dict[str, Any]:
    directory = generation.launch.fitted.get(FAMILY)
    state = _state(generation)
    found: dict[str, Any] = {"dir": str(directory) if directory else None, "restore": state.restore,
                             "save": state.save}
    store = store_of(generation)
    tiers = store.status() if store is not None else None
    if tiers is not None:
        found["tiers"] = {**tiers, "flush": state.flush}
    return found


def metrics(generation: Generation) -> None:
    store = store_of(generation)
    if store is not None:
        store.metrics()


def held(generation: Generation, running: Mapping[int, int]) -> int:
    """The tokens every slot holds, as the book knows them (what answers left there, what restores put there), and in
    a slot a request runs in, its prompt when that is more (`running`: slot -> its tokens; the book learns what it
    left once it ends)."""
    known = book_of(generation).held()
    return sum(max(known.get(slot, 0), running.get(slot, 0)) for slot in known.keys() | running.keys())


def restore_report(generation: Generation) -> list[dict[str, Any]]:
    """The last restore into this generation, one entry per saved slot."""
    return _state(generation).restore


async def save_step(generation: Generation) -> str:
    """The save before a reload: its failure is reported, never the end of the reload."""
    try:
        return await save(generation, flush=False)  # the next generation reads the same folder: no upload to wait for
    except ActionError as exc:
        log.warning("reload.step_failed", step="slots.save", error=str(exc))
        return f"slots.save failed: {exc}"


async def take_over(generation: Generation, pinned: bool) -> str:
    """Into a new generation: restore what it can use, prefill what it cannot (other cache types)."""
    try:
        summary = await restore(generation, pinned)
    except ActionError as exc:
        log.warning("reload.step_failed", step="slots.restore", error=str(exc))
        summary = f"slots.restore failed: {exc}"
    warmed = await warm(generation)
    return f"{summary}; {warmed}" if warmed else summary


# -- save -------------------------------------------------------------------------------------------------


async def save(generation: Generation, flush: bool = True) -> str:
    """Save every slot that holds tokens, then note which entry each holds; a slot whose save is empty or
    fails keeps what the note said. With an object store, then upload what only the folder holds (`flush`)."""
    store = _store(generation)
    started = time.monotonic()
    _sweep(store)
    if generation.launch.keep_saved:  # a built-in's fit made a save now worse than the states there are
        reason = generation.launch.keep_saved
        _state(generation).save = [{"outcome": "skipped", "reason": reason}]
        log.info("slots.save_skipped", reason=reason)
        return f"not saved: {reason}"
    try:
        slots = await generation.client.slots()
    except LlamaError as exc:
        raise ActionError(f"cannot read the server's slots: {exc}") from exc
    held: dict[int, Entry] = {}
    report = []
    for index, slot in enumerate(slots):
        PROGRESS.update(save=f"slot {index + 1} of {len(slots)}")
        report.append(await _guarded(_save_one(generation, store, slot, held),
                                     {"slot": slot.get("id"), "tokens": 0, "bytes": 0}))
    _state(generation).save = report
    _count("save", report, "saved")
    if held:
        try:
            store.note(layout.host_id(), held)
        except OSError as exc:
            raise ActionError(f"the note of what each slot holds could not be written: {exc}") from exc
        for each in store.evict(STORE.of(generation.config).budget, keep={e.key for e in held.values()},
                                shares=shares_of(generation.config)):
            METRICS.evicted(each.named, "folder")
    saved = [r for r in report if r["outcome"] == "saved"]
    failed = [r for r in report if r["outcome"] == "failed"]
    unchanged = [r for r in report if r["outcome"] == "unchanged"]
    summary = (f"saved {len(saved)} slot(s), {sum(r['tokens'] for r in saved)} tokens, "
               f"{sum(r['bytes'] for r in saved) / 1e6:.1f} MB in {time.monotonic() - started:.3f}s"
               + (f"; {len(unchanged)} unchanged since their last save or restore" if unchanged else ""))
    # before the pod goes: what only this folder holds goes to the tier behind it
    if flush and (flushed := await store.flush(STORE.of(generation.config).flush)) is not None:
        _state(generation).flush = flushed
        summary += f"; uploaded {flushed['uploaded']} to {flushed['store']}" + (
            f", {flushed['left']} left ({flushed['error']})" if flushed["left"] else "")
    if failed:
        raise ActionError(f"{summary}; {len(failed)} failed: {failed[0]['reason']}")
    return summary


async def _save_one(generation: Generation, store: Store, slot: dict[str, Any],
                    held: dict[int, Entry]) -> dict[str, Any]:
    number = int(slot["id"])
    entry: dict[str, Any] = {"slot": number, "outcome": "empty", "tokens": 0, "bytes": 0}
    if slot.get("n_prompt_tokens") == 0:  # absent after a restore: such a slot is saved again
        return entry
    book = book_of(generation)
    if (key := book.entry_of(number)) is not None and (known := store.get(key)) is not None:
        held[number] = known  # no request since its last save or restore: the store holds it already
        entry.update(outcome="unchanged", tokens=len(book.holds(number)), entry=key)
        log.info("slots.unchanged", slot=number, tokens=entry["tokens"])
        return entry
    try:
        saved = await save_into(generation, store, number)
    except NotSaved as exc:
        log.warning("slots.save_failed", slot=number, error=exc.reason)
        return {**entry, "outcome": "failed", "reason": exc.reason}
    if saved is None:
        log.info("slots.save_empty", slot=number)
        return entry
    held[number] = saved.entry
    entry.update(outcome="saved" if saved.new else "unchanged", tokens=saved.entry.n_tokens, entry=saved.entry.key)
    if not saved.new:  # the store held that state already (another host saved it, or it left its slot)
        log.info("slots.unchanged", slot=number, tokens=entry["tokens"])
        return entry
    entry.update(bytes=saved.entry.bytes, written=saved.entry.written, server_ms=saved.server_ms,
                 total_ms=saved.total_ms, file=saved.entry.name)
    log.info("slots.saved", **entry)
    return entry


# -- restore ----------------------------------------------------------------------------------------------


async def restore(generation: Generation, pinned: bool) -> str:
    """Restore what each slot held at this host's last stop, as far as the running server can use it; skip
    the rest with a reason. Never fails a start. `pinned`: every completion will be pinned to its slot (the
    conversation cache is on), so the book says what each slot holds from now on."""
    try:
        return await _restore(generation, pinned)
    finally:
        _state(generation).restored.set()


async def _restore(generation: Generation, pinned: bool) -> str:
    store = _store(generation)
    _sweep(store)
    await store.first_look(FIRST_LOOK_S)  # what the tier behind holds, before the first request looks for it
    book = book_of(generation)
    if pinned:
        book.pinned()
    held = store.held(layout.host_id())
    if not held:
        _state(generation).restore = []
        log.info("slots.restore_nothing", dir=str(generation.launch.fitted.get(FAMILY)))
        return "no saved slots"
    started = time.monotonic()
    try:
        settings = await server_layout_of(generation)
        book.learnt_version(await _state_version(generation, store))
    except (LlamaError, OSError, kvfile.SlotFileError) as exc:
        _state(generation).restore = [{"slot": h.slot, "outcome": "skipped",
                                       "reason": f"cannot query the server: {exc}"} for h in held]
        log.warning("slots.restore_skipped_all", error=str(exc))
        return f"skipped {len(held)} slot(s): {exc}"
    reuse = _state(generation).tracker(generation)
    sizes = [h.entry.bytes if h.entry else 0 for h in held]
    report = []
    for index, each in enumerate(held):
        PROGRESS.update(restore=f"slot {index + 1} of {len(held)}",
                        restore_mb=f"{sum(sizes[:index]) / 1e6:.1f} of {sum(sizes) / 1e6:.1f}")
        report.append(await _guarded(_restore_one(generation, store, each),
                                     {"slot": each.slot, "entry": each.key, "tokens": 0}))
    _state(generation).restore = report
    _count("restore", report, "restored")
    restored = [r for r in report if r["outcome"] == "restored"]
    for entry in restored:
        reuse.expect(entry, settings["total_slots"])
    await reuse.snapshot()
    return (f"restored {len(restored)} of {len(report)} slot(s), {sum(r['tokens'] for r in restored)} tokens "
            f"in {time.monotonic() - started:.3f}s")


async def _state_version(generation: Generation, store: Store) -> int:
    """The slot-file version this server writes, learnt by saving the (still empty) slot 0 once."""
    with store.part("probe") as probe:
        await generation.client.slot_action(0, "save", probe.name)
        return kvfile.version(probe)


async def _restore_one(generation: Generation, store: Store, held: Noted) -> dict[str, Any]:
    entry: dict[str, Any] = {"slot": held.slot, "entry": held.key, "file": held.entry.name if held.entry else None,
                             "outcome": "skipped", "tokens": held.n_tokens}
    if held.entry is None:
        return _skipped(entry, f"its state {held.key} is gone (evicted, or replaced by a longer state of its "
                               "conversation, which the conversation cache brings back)")
    if held.entry.consumer is None and consumers.isolating(CONSUMERS.of(generation.config)):
        return _skipped(entry, "nobody's (kept before `consumers:` named its consumer): under consumers.isolate no "
                               "request may reuse it, so it is left in the store and the slot kept free",
                        expected=True)
    try:
        done = await restore_into(generation, store, held.entry, held.slot)
    except NotRestored as exc:
        if exc.header is not None:
            entry.update(tokens=exc.header.n_tokens, bytes=exc.header.bytes)
        if exc.conversion is not None:
            entry["conversion"] = exc.conversion
        entry["warmable"] = exc.warmable
        return _skipped(entry, exc.reason, failed=exc.failed, expected=exc.kind in EXPECTED)
    entry.update(outcome="restored", entry=done.entry.key, file=done.entry.name, tokens=done.n_restored,
                 bytes=done.header.bytes, server_ms=done.server_ms, total_ms=done.total_ms,
                 saved_at=done.entry.record.get("saved_at"))
    if done.conversion is not None:
        entry["conversion"] = done.conversion
    log.info("slots.restored", **entry)
    return entry


async def warm(generation: Generation) -> str:
    """Prefill the tokens of each slot that could not be restored because the KV layout changed (a reload to
    other cache types, another build), so the next turn still finds its history in the cache. Says so."""
    rows = _warmable(generation)
    store = store_of(generation)
    if not rows or store is None:
        return ""
    started = time.monotonic()
    warmed = 0
    for row in rows:
        warmed += await _prefill(generation, store, row)
    await _state(generation).tracker(generation).snapshot()
    return f"prefilled {warmed} slot(s) that could not be restored in {time.monotonic() - started:.3f}s"


def _warmable(generation: Generation) -> list[dict[str, Any]]:
    return warmable(_state(generation).restore)


NO_SPACE = "no available space in kv cache"  # llama-server's refusal of a restore into a full unified cache


def warmable(report: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slots of a restore report worth prefilling: failed or skipped as another layout, but not those refused
    because the KV cache is full with what was restored (the slots together held more than its cells): a prefill
    would only push a restored conversation out again. Their conversations stay in the store for their next turn."""
    def retried(e: dict[str, Any]) -> bool:
        failed = e.get("outcome") == "failed" and bool(e.get("tokens"))
        return failed or (e.get("outcome") == "skipped" and bool(e.get("warmable")))

    return [e for e in report if retried(e) and NO_SPACE not in str(e.get("reason", "")).lower()]


async def _prefill(generation: Generation, store: Store, row: dict[str, Any]) -> int:
    """Prefill one slot the restore could not use with its saved tokens; 1 when done."""
    try:
        found = store.get(str(row["entry"]))
        if found is None:
            raise kvfile.SlotFileError(f"its state {row['entry']} is gone")
        tokens = found.tokens
        answer = await generation.client.prefill(int(row["slot"]), tokens)
    except (kvfile.SlotFileError, Unreadable, LlamaError) as exc:
        row["warm_error"] = str(exc)
        log.warning("slots.warm_failed", slot=row["slot"], error=str(exc))
        return 0
    book_of(generation).served(int(row["slot"]), tokens)
    row.update(outcome="prefilled", tokens=len(tokens),
               prefill_ms=round((answer.get("timings") or {}).get("prompt_ms") or 0.0, 1))
    _state(generation).tracker(generation).expect(row, int((await generation.props()).get("total_slots") or 1))
    METRICS.slot_ops.labels(operation="restore", outcome="prefilled").inc()
    log.info("slots.prefilled", slot=row["slot"], tokens=len(tokens), prefill_ms=row["prefill_ms"],
             why=row["reason"])
    return 1


async def background(host: Host) -> None:
    """From ready until the stop: the warm-up after a start, and the object store kept in step."""
    await asyncio.gather(warm_after_start(host), _sync(host))


async def _sync(host: Host) -> None:
    store = store_of(host.current)
    if store is not None:
        await store.background()


async def warm_after_start(host: Host) -> None:
    """In the background from ready: once the start's `slots.restore` has run, prefill the slots it could not
    use (another build's state that does not convert, other cache types), at most `slots.warm`, one at a time
    and only while no request is in flight (a client's request goes first). `/health` is not delayed."""
    generation = host.current
    await _state(generation).restored.wait()
    store = store_of(generation)
    rows = _warmable(generation)[:SLOTS.of(generation.config).warm]
    if store is None or not rows:
        return
    started, warmed = time.monotonic(), 0
    for row in rows:
        while host.in_flight or host.current is not generation:
            if host.current is not generation:
                return  # a reload took over: its own hand-over restores or prefills what it can
            await asyncio.sleep(WARM_IDLE_POLL_S)
        warmed += await _prefill(generation, store, row)
    await _state(generation).tracker(generation).snapshot()
    log.info("slots.warmed", warmed=warmed, of=len(rows), seconds=round(time.monotonic() - started, 3))


async def _guarded(work: Awaitable[dict[str, Any]], entry: dict[str, Any]) -> dict[str, Any]:
    """One slot's save or restore; a bug there is that slot's failure, never the others' or the start's."""
    try:
        return await work
    except ServerLost:
        raise
    except Exception as exc:
        log.exception("slots.internal_error", slot=entry.get("slot"))
        entry.setdefault("file", None)
        return {**entry, "outcome": "failed", "reason": f"internal error: {exc!r}"}


def _count(operation: str, report: list[dict[str, Any]], done: str) -> None:
    for entry in report:
        METRICS.slot_ops.labels(operation=operation, outcome=entry["outcome"]).inc()
        if entry["outcome"] == done:
            METRICS.slot_tokens.labels(operation=operation).inc(int(entry.get("tokens") or 0))
            METRICS.slot_bytes.labels(operation=operation).inc(int(entry.get("bytes") or 0))
            METRICS.slot_seconds.labels(operation=operation).observe(float(entry.get("total_ms") or 0) / 1000)


def _sweep(store: Store) -> None:
    removed = store.sweep()
    if removed:
        log.info("slots.swept", removed=removed)


EXPECTED = (Mismatch.MEDIA, Mismatch.NO_SUCH_SLOT)  # skipped, and nothing is wrong: logged at info


def _skipped(entry: dict[str, Any], reason: str, failed: bool = False, expected: bool = False) -> dict[str, Any]:
    """`expected`: a state with media while the server runs without its projector (the media built-in dropped it
    while idle, or the argv has none), or one saved from a slot this server has not (`-np` made smaller): its
    conversation is prefilled, or restored from the conversation cache, at its next turn; nothing is wrong."""
    entry.update(outcome="failed" if failed else "skipped", reason=reason)
    (log.info if expected else log.warning)("slots.restore_skipped", slot=entry["slot"], reason=reason,
                                            file=entry["file"])
    return entry
