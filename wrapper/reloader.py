"""The reload cycle: hold new requests, drain, save every slot, start the new llama-server, restore, release.

With overlap (blue-green) the new llama-server loads while the old one goes on serving, and requests are held
only from then on: the downtime is drain + save + restore, not the model load; without it the old one stops
first. A reload whose new server does not come
up rolls back to the previous argv and keeps serving; a SIGTERM during a reload stops with the slots saved.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from wrapper import argv as args
from wrapper import extensions
from wrapper.config import Config, ConfigError
from wrapper.generation import Generation
from wrapper.launch import Launch
from wrapper.lifecycle import State
from wrapper.llama import LlamaClient, LlamaError
from wrapper.reload_plan import ReloadPlan, ReloadRefused, plan
from wrapper.server_help import flag_arity
from wrapper.sysinfo import mem_available

if TYPE_CHECKING:
    from wrapper.supervisor import Supervisor

log = structlog.get_logger()

OVERLAP_MEMORY_FACTOR = 1.5  # auto overlap on CPU: MemAvailable must exceed this many times the model file


@dataclass(frozen=True)
class Prepared:
    plan: ReloadPlan
    config: Config
    launch: Launch
    overlap: bool
    overlap_why: str


class Reloader:
    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor

    def prepare(self, body: dict[str, Any], why: str | None = None) -> Prepared:
        """Check the request and settle the new generation's argv; ReloadRefused before anything stops.
        `why` (a built-in's reload, empty body): the built-ins' fit for the new generation is the change."""
        config = self.sup.config
        if why is not None and not body:
            reload_plan = ReloadPlan(list(config.argv))
        else:
            reload_plan = plan(config.argv, body, flag_arity(config.argv[0]))
        new_config = replace(config, argv=tuple(reload_plan.argv), swa_full=reload_plan.swa_full or config.swa_full)
        try:
            launch = replace(extensions.prepare(new_config, self.sup.shared), listen=self.sup.launch.listen)
        except ConfigError as exc:
            raise ReloadRefused(str(exc)) from exc
        if why is not None:
            reload_plan.changes = [why, *_argv_changes(self.sup.launch.argv, launch.argv)]
            if args.remove(launch.argv, args.PORT) == args.remove(self.sup.launch.argv, args.PORT):
                raise ReloadRefused(f"nothing to change ({why})", 409)
        overlap, overlap_why = self._overlap(launch)
        return Prepared(reload_plan, new_config, launch, overlap, overlap_why)

    def _overlap(self, launch: Launch) -> tuple[bool, str]:
        policy = self.sup.config.reload_overlap
        if policy != "auto":
            return policy == "always", f"reload.overlap is {policy}"
        layers = args.get(launch.argv, ("-ngl", "--gpu-layers", "--n-gpu-layers"))
        if layers not in (None, "0"):
            return False, "weights offloaded to a GPU would be loaded twice (-ngl): one server at a time"
        model_bytes = Path(launch.model.path).stat().st_size if launch.model.path else 0
        available = mem_available()
        if available is None:
            return False, "available memory unknown"
        fits = available > OVERLAP_MEMORY_FACTOR * model_bytes
        return fits, (f"{available / 2**30:.1f} GiB available, model file {model_bytes / 2**30:.2f} GiB "
                      f"({'enough' if fits else 'not enough'} for two servers side by side on CPU)")

    async def run(self, prepared: Prepared) -> dict[str, Any]:
        sup = self.sup
        old_config, old_launch, old_runtime, old_child = sup.config, sup.launch, sup.runtime, sup.child
        assert old_child is not None
        log.info("reload.begin", changes=prepared.plan.changes, overlap=prepared.overlap, why=prepared.overlap_why,
                 argv=prepared.launch.shown_argv)
        new_runtime = Generation(prepared.config, prepared.launch,
                              LlamaClient(prepared.launch.url, sup.session, prepared.launch.api_key),
                              shared=sup.shared, host=sup)
        try:
            if prepared.overlap:  # blue-green: the old server keeps serving while the new one loads
                try:
                    await sup.spawn_ready(prepared.launch, new_runtime)
                except Exception as exc:  # nothing was disturbed: the old server never stopped serving
                    return await self._roll_back(prepared, old_config, old_launch, old_runtime, None, str(exc))
            began = time.monotonic()
            sup.lifecycle.to(State.RELOADING)  # the gate holds new requests from here: the downtime begins
            await sup.drain(sup.config.reload_drain_timeout)
            saved = await extensions.hand_over(old_runtime)
            if not prepared.overlap:
                await sup.stop_child(old_child)
                try:
                    await sup.spawn_ready(prepared.launch, new_runtime)
                except Exception as exc:  # StartFailed, or a bug: either way the previous server comes back
                    return await self._roll_back(prepared, old_config, old_launch, old_runtime, began, str(exc))
            sup.install(prepared.config, prepared.launch, new_runtime)
            restored = await extensions.take_over(new_runtime)
            sup.lifecycle.to(State.READY)  # the held requests go to the new server
            downtime_ms = round((time.monotonic() - began) * 1000, 1)
            if prepared.overlap:
                await sup.stop_child(old_child)
        finally:  # also when a SIGTERM cancels the reload: a new server that did not take over is stopped
            new_child = new_runtime.child
            if new_child is not None and new_child is not sup.child and new_child.alive:
                await sup.stop_child(new_child)
        return await self._answer(prepared, True, "reloaded", downtime_ms, saved, restored, new_runtime)

    async def _roll_back(self, prepared: Prepared, old_config: Config, old_launch: Launch, old_runtime: Generation,
                         began: float | None, reason: str) -> dict[str, Any]:
        """`began` is None when the new server failed before anything was held (overlap): nothing to undo."""
        sup = self.sup
        log.warning("reload.failed", reason=reason, overlap=prepared.overlap)
        if began is not None:
            try:
                await sup.spawn_ready(old_launch, old_runtime)
            except Exception as exc:
                log.error("reload.rollback_failed", error=str(exc))
                sup.request_stop()  # nothing is left to serve with: stop as if signalled, slots already saved
                raise
            sup.install(old_config, old_launch, old_runtime)
            await extensions.take_over(old_runtime)
            sup.lifecycle.to(State.READY)
        downtime_ms = round((time.monotonic() - began) * 1000, 1) if began is not None else 0.0
        return await self._answer(prepared, False, f"reload failed, the previous settings are back: {reason}",
                                  downtime_ms, None, None, sup.runtime)

    async def _answer(self, prepared: Prepared, success: bool, message: str, downtime_ms: float,
                      saved: str | None, restored: str | None, runtime: Generation) -> dict[str, Any]:
        try:
            props = await runtime.client.props()
            n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 0)
        except LlamaError:
            n_ctx = 0
        if not prepared.config.uses("slots"):
            message += " (no slots.save/slots.restore hooks: conversations are prefilled again)"
        restore_report = extensions.status(runtime).get("slots", {}).get("restore", [])
        answer = {
            "success": success, "n_ctx": n_ctx, "message": message, "downtime_ms": downtime_ms,
            "overlap": prepared.overlap, "overlap_why": prepared.overlap_why, "changes": prepared.plan.changes,
            "save": saved, "restore": restored, "slots": restore_report if success else [],
        }
        log.info("reload.done", **{k: v for k, v in answer.items() if k != "slots"})
        self.sup.last_reload = answer
        await self.sup.run_hook("on_reload")
        return answer


def _argv_changes(old: list[str], new: list[str]) -> list[str]:
    """What differs between two generations' command lines, flag by flag (`-c 2048 -> 3584`), the port aside."""
    before, after = _options(args.remove(old, args.PORT)), _options(args.remove(new, args.PORT))
    changes = [f"{flag} {before.get(flag) or 'on'} -> {after[flag] or 'on'}" if flag in before
               else f"{flag}{' ' + after[flag] if after[flag] else ''} added"
               for flag in after if before.get(flag, "\0") != after[flag]]
    return changes + [f"{flag} removed" for flag in before if flag not in after]


def _options(argv: list[str]) -> dict[str, str]:
    """Each flag of a command line with the value that follows it ("" for a switch); the last one wins."""
    def is_flag(arg: str) -> bool:
        return arg.startswith("-") and not arg.lstrip("-").replace(".", "").isdigit()  # -1 is a value

    found: dict[str, str] = {}
    for index, arg in enumerate(argv[1:], start=1):
        if is_flag(arg):
            name, eq, inline = arg.partition("=")
            following = argv[index + 1] if index + 1 < len(argv) else ""
            found[name] = inline if eq else following if following and not is_flag(following) else ""
    return found
