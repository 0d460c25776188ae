"""Built-ins `slots.save` and `slots.restore`: slot KV caches kept across restarts, never a good file lost.

Files: `<slots.dir>/<model-id>/slot<N>.json` (our sidecar, the record of the current save) and the KV file it
names, `slot<N>-<fingerprint>.bin` (what llama-server wrote). A save goes to a temporary name, is parsed
back, and only then replaces the previous pair, in one step (see hooks/slotdir.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from hooks import kvconvert, slotdir, slotfile
from hooks.compat import Mismatch, server_settings, skip_reason
from hooks.reuse import ReuseTracker
from wrapper.actions import ActionError
from wrapper.generation import Generation, ServerLost
from wrapper.llama import LlamaError
from wrapper.metrics import METRICS
from wrapper.progress import PROGRESS
from wrapper.proxy import Observer
from wrapper.settings import BOOL, COUNT, NUMBER, PATH, SIZE, SIZE_OR_AUTO, Section, choice, setting

log = structlog.get_logger()

FAMILY = "slots"


@dataclass(frozen=True)
class SlotSettings:
    dir: Path = setting(Path("~/.cache/llama-wrapper/slots").expanduser(), PATH,
                        "where slot files are kept, one folder per model id (also `--slots-dir`)")
    swa_full: str = setting("auto", choice("auto", "always", "never"),
                            "add `--swa-full` so that restored slots of sliding-window models are reused")
    cache: bool = setting(True, BOOL, "the conversation cache: pin requests to slots, keep every conversation "
                          "that leaves a slot on disk and restore it when it comes back (with `slots.restore`)")
    cache_budget: int = setting(20 << 30, SIZE, "the conversation cache's size on disk: the least recently used "
                                "conversations go first")
    cache_entry_max: int = setting(4 << 30, SIZE, "a conversation larger than this is not kept")
    cache_min_free: int = setting(2 << 30, SIZE, "no conversation is written when less than this is free on disk")
    min_tokens: int = setting(256, COUNT, "shorter conversations are not kept, and a restore must win this many "
                              "tokens over what the slot holds")
    restore_margin: float = setting(1.2, NUMBER, "restore when the predicted restore time times this is below "
                                    "the predicted prefill time")
    restore_rate: int | None = setting(None, SIZE_OR_AUTO, "bytes per second a restore reads (`auto`: measured; "
                                       "give one for a slow disk)")


SLOTS = Section(FAMILY, SlotSettings, "slot persistence (`slots.save`, `slots.restore`)")

_LOG_HINT = re.compile(r"error|fail|mismatch|incompatible|invalid|unknown", re.IGNORECASE)


@dataclass
class SlotState:
    """What the slot built-ins know of one generation: the last save and restore, and the reuse watch."""

    save: list[dict[str, Any]] = field(default_factory=list)
    restore: list[dict[str, Any]] = field(default_factory=list)
    reuse: ReuseTracker | None = None
    held: dict[int, list[int]] = field(default_factory=dict)  # the tokens each slot holds, as far as we know
    dirty: set[int] = field(default_factory=set)  # slots that served a request since their last save or restore
    pinned: bool = False  # requests are pinned to slots (the conversation cache): `dirty` is exact
    settings: dict[str, Any] | None = None  # the server's layout settings, once asked
    total_slots: int = 0  # -np as the server reports it, once asked
    pairs: dict[int, slotdir.SavedSlot] = field(default_factory=dict)  # slot files equal to what a slot holds

    def tracker(self, rt: Generation) -> ReuseTracker:
        if self.reuse is None:
            self.reuse = ReuseTracker(rt.client)
        return self.reuse


def state_of(rt: Generation) -> SlotState:
    return _state(rt)


def _state(rt: Generation) -> SlotState:
    state = rt.state.setdefault(FAMILY, SlotState())
    assert isinstance(state, SlotState)
    return state


def _directory(rt: Generation) -> Path:
    directory = rt.launch.fitted.get(FAMILY)
    if not isinstance(directory, Path):
        raise ActionError("slot persistence is off: the wrapper did not prepare a slot folder")
    return directory


# -- what the registry declares (hooks/registry.py) -------------------------------------------------------


def observer(rt: Generation) -> Observer | None:
    reuse = _state(rt).reuse
    return reuse.observer() if reuse is not None else None


def status(rt: Generation) -> dict[str, Any]:
    directory = rt.launch.fitted.get(FAMILY)
    state = _state(rt)
    return {"dir": str(directory) if directory else None, "restore": state.restore, "save": state.save}


def restore_report(rt: Generation) -> list[dict[str, Any]]:
    """The last restore into this generation, one entry per saved slot."""
    return _state(rt).restore


def restored_tokens(rt: Generation) -> list[int]:
    """Tokens of each slot restored (or prefilled) into this generation."""
    return [int(e.get("tokens") or 0) for e in _state(rt).restore if e.get("outcome") in ("restored", "prefilled")]


async def save_step(rt: Generation) -> str:
    """The save before a reload: its failure is reported, never the end of the reload."""
    try:
        return await save(rt)
    except ActionError as exc:
        log.warning("reload.step_failed", step="slots.save", error=str(exc))
        return f"slots.save failed: {exc}"


async def take_over(rt: Generation) -> str:
    """Into a new generation: restore what it can use, prefill what it cannot (other cache types)."""
    try:
        summary = await restore(rt)
    except ActionError as exc:
        log.warning("reload.step_failed", step="slots.restore", error=str(exc))
        summary = f"slots.restore failed: {exc}"
    warmed = await warm(rt)
    return f"{summary}; {warmed}" if warmed else summary


async def _settings(rt: Generation) -> dict[str, Any]:
    props = await rt.client.props()
    return server_settings(rt.launch.argv, rt.launch.env, props, rt.launch.facts)


# -- save -------------------------------------------------------------------------------------------------


async def save(rt: Generation) -> str:
    """Save every slot that holds tokens; keep the previous file whenever a save is empty or fails."""
    directory = _directory(rt)
    started = time.monotonic()
    _sweep(directory)
    if rt.launch.keep_saved:  # a built-in's fit made a save now worse than the files there are
        reason = rt.launch.keep_saved
        _state(rt).save = [{"outcome": "skipped", "reason": reason}]
        log.info("slots.save_skipped", reason=reason)
        return f"not saved: {reason}"
    try:
        slots = await rt.client.slots()
        settings = await _settings(rt)
    except LlamaError as exc:
        raise ActionError(f"cannot read the server's slots: {exc}") from exc
    report = []
    for index, slot in enumerate(slots):
        PROGRESS.update(save=f"slot {index + 1} of {len(slots)}")
        report.append(await _guarded(_save_one(rt, directory, slot, settings),
                                     {"slot": slot.get("id"), "tokens": 0, "bytes": 0}))
    _state(rt).save = report
    _count("save", report, "saved")
    saved = [r for r in report if r["outcome"] == "saved"]
    failed = [r for r in report if r["outcome"] == "failed"]
    unchanged = [r for r in report if r["outcome"] == "unchanged"]
    summary = (f"saved {len(saved)} slot(s), {sum(r['tokens'] for r in saved)} tokens, "
               f"{sum(r['bytes'] for r in saved) / 1e6:.1f} MB in {time.monotonic() - started:.3f}s"
               + (f"; {len(unchanged)} unchanged since their last save or restore" if unchanged else ""))
    if failed:
        raise ActionError(f"{summary}; {len(failed)} failed: {failed[0]['reason']}")
    return summary


async def _save_one(rt: Generation, directory: Path, slot: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    number = int(slot["id"])
    entry: dict[str, Any] = {"slot": number, "outcome": "empty", "tokens": 0, "bytes": 0}
    if slot.get("n_prompt_tokens") == 0:  # absent after a restore: such a slot is saved again
        return entry
    state = _state(rt)
    if state.pinned and number not in state.dirty and (directory / f"slot{number}.json").exists():
        entry.update(outcome="unchanged", tokens=len(state.held.get(number, [])))
        log.info("slots.unchanged", slot=number, tokens=entry["tokens"])
        return entry  # no request since its last save or restore: the pair on disk holds it already
    temporary = directory / f"slot{number}.bin.{os.getpid()}.tmp"  # two wrappers of one model never collide
    started = time.monotonic()
    try:
        answer = await rt.client.slot_action(number, "save", temporary.name)
        if int(answer.get("n_saved", 0)) == 0:
            log.info("slots.save_empty", slot=number, kept_previous=bool(slotdir.saved_slots(directory)))
            return entry
        header = slotfile.read(temporary)  # a file we cannot read back never replaces a good one
        record = {
            "model": rt.launch.model.as_dict(), "tokens": header.n_tokens, "state_version": header.version,
            **{k: settings[k] for k in ("cache_type_k", "cache_type_v", "flash_attn", "swa_full", "kv_unified",
                                       "kv_streams", "total_slots", "n_ctx", "attn_rot_disable", "build")},
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "save_ms": (answer.get("timings") or {}).get("save_ms"),
        }
        final = slotdir.commit(directory, number, temporary, record)
        state.held[number] = header.tokens
        state.dirty.discard(number)
        state.pairs[number] = slotdir.SavedSlot(number, slotdir.sidecar_path(directory, number), final)
    except (LlamaError, slotfile.SlotFileError, OSError) as exc:
        log.warning("slots.save_failed", slot=number, error=str(exc))
        return {**entry, "outcome": "failed", "reason": f"save failed: {exc}"}
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()
    entry.update(outcome="saved", tokens=header.n_tokens, bytes=header.bytes, server_ms=record["save_ms"],
                 total_ms=round((time.monotonic() - started) * 1000, 1), file=str(final))
    log.info("slots.saved", **entry)
    return entry


# -- restore ----------------------------------------------------------------------------------------------


async def restore(rt: Generation) -> str:
    """Restore each saved slot the running server can use; skip the rest with a reason. Never fails a start."""
    directory = _directory(rt)
    _sweep(directory)
    _state(rt).pinned = SLOTS.of(rt.config).cache  # every completion is pinned from now on: `dirty` is exact
    files = slotdir.saved_slots(directory)
    if not files:
        _state(rt).restore = []
        log.info("slots.restore_nothing", dir=str(directory))
        return "no saved slots"
    started = time.monotonic()
    try:
        settings = await _settings(rt)
        state_version = await _state_version(rt, directory)
    except (LlamaError, OSError, slotfile.SlotFileError) as exc:
        _state(rt).restore = [{"slot": saved.slot, "outcome": "skipped", "reason": f"cannot query the server: {exc}"}
                             for saved in files]
        log.warning("slots.restore_skipped_all", error=str(exc))
        return f"skipped {len(files)} slot(s): {exc}"
    reuse = _state(rt).tracker(rt)
    sizes = [saved.kv_file.stat().st_size if saved.kv_file.exists() else 0 for saved in files]
    report = []
    for index, saved in enumerate(files):
        PROGRESS.update(restore=f"slot {index + 1} of {len(files)}",
                        restore_mb=f"{sum(sizes[:index]) / 1e6:.1f} of {sum(sizes) / 1e6:.1f}")
        report.append(await _guarded(_restore_one(rt, saved, settings, state_version),
                                     {"slot": saved.slot, "file": str(saved.kv_file), "tokens": 0}))
    _state(rt).restore = report
    _count("restore", report, "restored")
    restored = [r for r in report if r["outcome"] == "restored"]
    for entry in restored:
        reuse.expect(entry, settings["total_slots"])
    await reuse.snapshot()
    return (f"restored {len(restored)} of {len(report)} slot(s), {sum(r['tokens'] for r in restored)} tokens "
            f"in {time.monotonic() - started:.3f}s")


async def _state_version(rt: Generation, directory: Path) -> int:
    """The slot-file version this server writes, learnt by saving the (still empty) slot 0 once."""
    probe = directory / f".probe-state-version.{os.getpid()}.bin"
    try:
        await rt.client.slot_action(0, "save", probe.name)
        return slotfile.version(probe)
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


async def _restore_one(rt: Generation, saved: slotdir.SavedSlot, settings: dict[str, Any],
                       state_version: int) -> dict[str, Any]:
    number, path = saved.slot, saved.kv_file
    entry: dict[str, Any] = {"slot": number, "file": str(path), "outcome": "skipped", "tokens": 0}
    try:
        sidecar = slotdir.read_sidecar(saved.sidecar)
        slotdir.check_pair(sidecar, path)
    except slotdir.SidecarError as exc:
        return _skipped(entry, f"no usable sidecar: {exc}")
    try:
        header = slotfile.read(path)
        entry["tokens"] = header.n_tokens
        entry["bytes"] = header.bytes
    except slotfile.SlotFileError as exc:
        return _skipped(entry, f"unreadable file: {exc}")
    skip = skip_reason(number, sidecar, header, rt.launch.model.id, settings, state_version)
    if skip is not None and skip.kind is Mismatch.CACHE_TYPES:  # the same tokens in other types: convert the file
        converted = await asyncio.to_thread(_converted, rt, saved, sidecar, settings, entry)  # /health answers
        if converted is not None:
            sidecar, header, path = converted
            skip = skip_reason(number, sidecar, header, rt.launch.model.id, settings, state_version)
    if skip is not None:
        entry["warmable"] = skip.warmable
        return _skipped(entry, skip.reason)
    mark = rt.child.lines_seen if rt.child else 0
    started = time.monotonic()
    try:
        answer = await rt.client.slot_action(number, "restore", path.name)
    except LlamaError as exc:
        said = await _server_says(rt, mark)
        if exc.status is None and await _died(rt):  # no answer at all: did it die?
            reason = f"llama-server died restoring it: {exc}{said}"
            folder = slotdir.set_aside(saved, reason)
            log.error("slots.set_aside", slot=number, file=str(path), to=str(folder), reason=reason)
            raise ServerLost(f"llama-server died restoring slot {number} from {path.name}; the file was set "
                             f"aside in {folder}") from exc
        return _skipped(entry, f"the server refused it: {exc}{said}", failed=True)
    _state(rt).held[number] = header.tokens
    _state(rt).dirty.discard(number)
    _state(rt).pairs[number] = slotdir.SavedSlot(number, saved.sidecar, path)
    entry.update(outcome="restored", tokens=int(answer.get("n_restored", header.n_tokens)),
                 server_ms=(answer.get("timings") or {}).get("restore_ms"),
                 total_ms=round((time.monotonic() - started) * 1000, 1), saved_at=sidecar.get("saved_at"))
    log.info("slots.restored", **entry)
    return entry


async def warm(rt: Generation) -> str:
    """Prefill the tokens of each slot that could not be restored because the KV layout changed (a reload to
    other cache types, another build), so the next turn still finds its history in the cache. Says so."""
    entries = [e for e in _state(rt).restore if (e.get("outcome") == "failed" and e.get("tokens"))
               or (e.get("outcome") == "skipped" and e.get("warmable"))]
    if not entries:
        return ""
    reuse = _state(rt).tracker(rt)
    started = time.monotonic()
    total_slots = int((await rt.client.props()).get("total_slots") or 1)
    warmed = 0
    for entry in entries:
        try:
            tokens = slotfile.read(entry["file"]).tokens
            answer = await rt.client.prefill(int(entry["slot"]), tokens)
        except (slotfile.SlotFileError, LlamaError) as exc:
            entry["warm_error"] = str(exc)
            log.warning("slots.warm_failed", slot=entry["slot"], error=str(exc))
            continue
        entry.update(outcome="prefilled", tokens=len(tokens),
                     prefill_ms=round((answer.get("timings") or {}).get("prompt_ms") or 0.0, 1))
        reuse.expect(entry, total_slots)
        METRICS.slot_ops.labels(operation="restore", outcome="prefilled").inc()
        warmed += 1
        log.info("slots.prefilled", slot=entry["slot"], tokens=len(tokens), prefill_ms=entry["prefill_ms"],
                 why=entry["reason"])
    await reuse.snapshot()
    return f"prefilled {warmed} slot(s) that could not be restored in {time.monotonic() - started:.3f}s"


def _converted(rt: Generation, saved: slotdir.SavedSlot, sidecar: dict[str, Any], settings: dict[str, Any],
               entry: dict[str, Any]) -> tuple[dict[str, Any], slotfile.SlotFile, Path] | None:
    """Rewrite a slot's KV file into the server's cache types and make it the slot's current pair."""
    directory = saved.kv_file.parent
    disabled = bool(settings["attn_rot_disable"])
    temporary = directory / f"slot{saved.slot}.bin.{os.getpid()}.tmp"
    try:
        done = convert_for(rt, saved.kv_file, temporary, settings)
        header = slotfile.read(temporary)
        record = {k: v for k, v in sidecar.items() if k not in ("format", "slot", "file", "bytes", "fingerprint")}
        record.update(cache_type_k=settings["cache_type_k"], cache_type_v=settings["cache_type_v"],
                      attn_rot_disable=disabled, converted_from=f"{sidecar.get('cache_type_k')}/"
                      f"{sidecar.get('cache_type_v')}")
        final = slotdir.commit(directory, saved.slot, temporary, record)
    except (kvconvert.NotConvertible, slotfile.SlotFileError, OSError) as exc:
        entry["conversion"] = f"not converted: {exc}"
        log.info("slots.not_converted", slot=saved.slot, reason=str(exc))
        return None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()
    entry.update(file=str(final), bytes=header.bytes,
                 conversion={"from": record["converted_from"], "to": f"{settings['cache_type_k']}/"
                             f"{settings['cache_type_v']}", "ms": round(done.seconds * 1000, 1),
                             "mb_per_s": round(done.mb_per_s, 1)})
    log.info("slots.converted", slot=saved.slot, **entry["conversion"])
    return slotdir.read_sidecar(saved.sidecar), header, final


def convert_for(rt: Generation, source: Path, target: Path, settings: dict[str, Any]) -> kvconvert.Conversion:
    """Rewrite a state file into the running server's cache types and rotation (NotConvertible if it cannot)."""
    disabled = bool(settings["attn_rot_disable"])
    rot_k = kvconvert.target_rotation(settings["cache_type_k"], rt.launch.facts.get("head_dim_k"), True, disabled)
    rot_v = kvconvert.target_rotation(settings["cache_type_v"], rt.launch.facts.get("head_dim_v"), False, disabled)
    return kvconvert.convert(source, target, settings["cache_type_k"], settings["cache_type_v"], rot_k, rot_v,
                             lambda read, size: PROGRESS.update(conversion_mb=f"{read / 1e6:.1f} of {size / 1e6:.1f}"))


async def server_settings_of(rt: Generation) -> dict[str, Any]:
    """The running server's settings that decide a state file's layout (asked once per generation)."""
    state = _state(rt)
    if state.settings is None:
        state.settings = await _settings(rt)
    return state.settings


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


def _sweep(directory: Path) -> None:
    removed = slotdir.sweep(directory)
    if removed:
        log.info("slots.swept", dir=str(directory), removed=removed)


def _skipped(entry: dict[str, Any], reason: str, failed: bool = False) -> dict[str, Any]:
    entry.update(outcome="failed" if failed else "skipped", reason=reason)
    log.warning("slots.restore_skipped", slot=entry["slot"], reason=reason, file=entry["file"])
    return entry


async def _died(rt: Generation, within: float = 2.0) -> bool:
    """Whether llama-server is gone (a failed request may come just before its exit is seen)."""
    if rt.child is None:
        return False
    for _ in range(int(within / 0.05)):
        if not rt.child.alive:
            return True
        await asyncio.sleep(0.05)
    return False


async def _server_says(rt: Generation, mark: int) -> str:
    """The real cause of a failed restore is only in the server's log: wait briefly for it and quote it."""
    if rt.child is None:
        return ""
    for _ in range(20):
        lines = [line for line in rt.child.lines_since(mark) if _LOG_HINT.search(line)]
        if lines:
            return " (server log: " + " | ".join(line.strip() for line in lines[-2:]) + ")"
        await asyncio.sleep(0.01)
    return ""
