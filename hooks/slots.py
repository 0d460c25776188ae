"""Built-ins `slots.save` and `slots.restore`: slot KV caches kept across restarts, never a good file lost.

Files: `<slots.dir>/<model-id>/slot<N>.bin` (what llama-server wrote) and `slot<N>.json` (our sidecar).
A save goes to a temporary name, is parsed back, and only then replaces the previous pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from hooks import slotfile
from hooks.compat import server_settings, skip_reason
from hooks.reuse import ReuseTracker
from wrapper.actions import ActionError
from wrapper.llama import LlamaError
from wrapper.runtime import Runtime

log = structlog.get_logger()

SIDECAR_FORMAT = 1
_SLOT_FILE = re.compile(r"^slot(\d+)\.bin$")
_LOG_HINT = re.compile(r"error|fail|mismatch|incompatible|invalid|unknown", re.IGNORECASE)


def slot_paths(directory: Path, slot: int) -> tuple[Path, Path]:
    return directory / f"slot{slot}.bin", directory / f"slot{slot}.json"


def saved_slots(directory: Path) -> list[tuple[int, Path]]:
    found = []
    for path in directory.glob("slot*.bin") if directory.is_dir() else []:
        match = _SLOT_FILE.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_sidecar(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{path.name} is not a llama-wrapper sidecar of format {SIDECAR_FORMAT}")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> Path:
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(temporary, "w") as out:
        json.dump(data, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    return temporary


def _directory(rt: Runtime) -> Path:
    if rt.launch.slot_dir is None:
        raise ActionError("slot persistence is off: the wrapper did not prepare a slot folder")
    return rt.launch.slot_dir


async def _settings(rt: Runtime) -> dict[str, Any]:
    props = await rt.client.props()
    return server_settings(rt.launch.argv, rt.launch.env, props, rt.launch.facts)


# -- save -------------------------------------------------------------------------------------------------


async def save(rt: Runtime) -> str:
    """Save every slot that holds tokens; keep the previous file whenever a save is empty or fails."""
    directory = _directory(rt)
    started = time.monotonic()
    try:
        slots = await rt.client.slots()
        settings = await _settings(rt)
    except LlamaError as exc:
        raise ActionError(f"cannot read the server's slots: {exc}") from exc
    report = [await _save_one(rt, directory, slot, settings) for slot in slots]
    rt.save_report = report
    saved = [r for r in report if r["outcome"] == "saved"]
    failed = [r for r in report if r["outcome"] == "failed"]
    summary = (f"saved {len(saved)} slot(s), {sum(r['tokens'] for r in saved)} tokens, "
               f"{sum(r['bytes'] for r in saved) / 1e6:.1f} MB in {time.monotonic() - started:.3f}s")
    if failed:
        raise ActionError(f"{summary}; {len(failed)} failed: {failed[0]['reason']}")
    return summary


async def _save_one(rt: Runtime, directory: Path, slot: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    number = int(slot["id"])
    entry: dict[str, Any] = {"slot": number, "outcome": "empty", "tokens": 0, "bytes": 0}
    if slot.get("n_prompt_tokens") == 0:  # absent after a restore: such a slot is saved again
        return entry
    final_bin, final_json = slot_paths(directory, number)
    temporary = directory / f"slot{number}.bin.{os.getpid()}.tmp"  # two wrappers of one model never collide
    started = time.monotonic()
    try:
        answer = await rt.client.slot_action(number, "save", temporary.name)
        if int(answer.get("n_saved", 0)) == 0:
            log.info("slots.save_empty", slot=number, kept_previous=final_bin.exists())
            return entry
        header = slotfile.read(temporary)  # a file we cannot read back never replaces a good one
        sidecar = {
            "format": SIDECAR_FORMAT, "slot": number, "model": rt.launch.model.as_dict(),
            "tokens": header.n_tokens, "bytes": header.bytes, "state_version": header.version,
            **{k: settings[k] for k in ("cache_type_k", "cache_type_v", "flash_attn", "swa_full", "kv_unified",
                                       "kv_streams", "total_slots", "n_ctx", "attn_rot_disable", "build")},
            "saved_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "save_ms": (answer.get("timings") or {}).get("save_ms"),
        }
        sidecar_tmp = _write_json(final_json, sidecar)
        os.replace(temporary, final_bin)
        os.replace(sidecar_tmp, final_json)
    except (LlamaError, slotfile.SlotFileError, OSError) as exc:
        log.warning("slots.save_failed", slot=number, error=str(exc), kept_previous=final_bin.exists())
        return {**entry, "outcome": "failed", "reason": str(exc)}
    finally:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
    entry.update(outcome="saved", tokens=header.n_tokens, bytes=header.bytes, server_ms=sidecar["save_ms"],
                 total_ms=round((time.monotonic() - started) * 1000, 1), file=str(final_bin))
    log.info("slots.saved", **entry)
    return entry


# -- restore ----------------------------------------------------------------------------------------------


async def restore(rt: Runtime) -> str:
    """Restore each saved slot the running server can use; skip the rest with a reason. Never fails a start."""
    directory = _directory(rt)
    files = saved_slots(directory)
    if not files:
        rt.restore_report = []
        log.info("slots.restore_nothing", dir=str(directory))
        return "no saved slots"
    started = time.monotonic()
    try:
        settings = await _settings(rt)
        state_version = await _state_version(rt, directory)
    except (LlamaError, OSError, slotfile.SlotFileError) as exc:
        rt.restore_report = [{"slot": n, "outcome": "skipped", "reason": f"cannot query the server: {exc}"}
                             for n, _ in files]
        log.warning("slots.restore_skipped_all", error=str(exc))
        return f"skipped {len(files)} slot(s): {exc}"
    if rt.reuse is None:
        rt.reuse = ReuseTracker(rt.client)
    report = [await _restore_one(rt, number, path, settings, state_version) for number, path in files]
    rt.restore_report = report
    restored = [r for r in report if r["outcome"] == "restored"]
    for entry in restored:
        rt.reuse.expect(entry, settings["total_slots"])
    return (f"restored {len(restored)} of {len(report)} slot(s), {sum(r['tokens'] for r in restored)} tokens "
            f"in {time.monotonic() - started:.3f}s")


async def _state_version(rt: Runtime, directory: Path) -> int:
    """The slot-file version this server writes, learnt by saving the (still empty) slot 0 once."""
    probe = directory / f".probe-state-version.{os.getpid()}.bin"
    try:
        await rt.client.slot_action(0, "save", probe.name)
        with open(probe, "rb") as handle:
            return int.from_bytes(handle.read(8)[4:8], "little")
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


async def _restore_one(rt: Runtime, number: int, path: Path, settings: dict[str, Any],
                       state_version: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"slot": number, "file": str(path), "outcome": "skipped", "tokens": 0}
    try:
        header = slotfile.read(path)
        entry["tokens"] = header.n_tokens
        entry["bytes"] = header.bytes
    except slotfile.SlotFileError as exc:
        return _skipped(entry, f"unreadable file: {exc}")
    try:
        sidecar = read_sidecar(slot_paths(path.parent, number)[1])
    except (OSError, ValueError) as exc:
        return _skipped(entry, f"no usable sidecar: {exc}")
    reason = skip_reason(number, sidecar, header, rt.launch.model.id, settings, state_version)
    if reason:
        return _skipped(entry, reason)
    mark = rt.child.lines_seen if rt.child else 0
    started = time.monotonic()
    try:
        answer = await rt.client.slot_action(number, "restore", path.name)
    except LlamaError as exc:
        return _skipped(entry, f"the server refused it: {exc}{await _server_says(rt, mark)}", failed=True)
    entry.update(outcome="restored", tokens=int(answer.get("n_restored", header.n_tokens)),
                 server_ms=(answer.get("timings") or {}).get("restore_ms"),
                 total_ms=round((time.monotonic() - started) * 1000, 1), saved_at=sidecar.get("saved_at"))
    log.info("slots.restored", **entry)
    return entry


def _skipped(entry: dict[str, Any], reason: str, failed: bool = False) -> dict[str, Any]:
    entry.update(outcome="failed" if failed else "skipped", reason=reason)
    log.warning("slots.restore_skipped", slot=entry["slot"], reason=reason, file=entry["file"])
    return entry


async def _server_says(rt: Runtime, mark: int) -> str:
    """The real cause of a failed restore is only in the server's log: wait briefly for it and quote it."""
    if rt.child is None:
        return ""
    for _ in range(20):
        lines = [line for line in rt.child.lines_since(mark) if _LOG_HINT.search(line)]
        if lines:
            return " (server log: " + " | ".join(line.strip() for line in lines[-2:]) + ")"
        await asyncio.sleep(0.01)
    return ""
