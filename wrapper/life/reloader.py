"""The reload cycle: hold new requests, drain, save every slot, start the new llama-server, restore, release.

With overlap (blue-green) the new llama-server loads while the old one goes on serving, and requests are held
only from then on: the downtime is drain + save + restore, not the model load; without it the old one stops
first. A reload whose new server does not come up rolls back to the previous argv and keeps serving; a SIGTERM
during a reload stops with the slots saved. The cycle returns its answer; what serves (wrapper/serving.py) keeps
it and runs on_reload.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

import structlog

from wrapper import built_ins
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.reload_plan import Refusal, ReloadPlan, ReloadRefused, plan
from wrapper.launching.flags import flag_arity
from wrapper.launching.launch import Asks, Launch
from wrapper.launching.sysinfo import mem_available
from wrapper.metrics import METRICS
from wrapper.progress import PROGRESS
from wrapper.server.context import (
    TRAINING_CONTEXT,
    ServerContext,
    asked_context,
    expected_context,
    share,
    training_context,
    with_context,
)
from wrapper.server.generation import Generation
from wrapper.server.llama import LlamaError

log = structlog.get_logger()
T = TypeVar("T")

OVERLAP_MEMORY_FACTOR = 1.5  # auto overlap on CPU: MemAvailable must exceed this many times the model file


class ReloadHost(Protocol):
    """What a reload needs of the server's life (wrapper/life/server_life.py): it holds, installs and releases; the
    reload never changes the state itself."""

    @property
    def current(self) -> Generation: ...

    def new_generation(self, config: Config, launch: Launch) -> Generation: ...

    def hold(self) -> None:
        """The downtime begins: requests are held."""

    def install(self, generation: Generation) -> None: ...

    def release(self) -> None:
        """The held requests go to what serves now."""

    async def drain(self, timeout: float, cut: bool = True) -> bool: ...

    def carry_streams(self) -> int:
        """Cut the streams in flight that go on on the next server; how many."""
        ...

    async def survived(self, generation: Generation, step: Callable[[], Awaitable[T]]) -> T:
        """Run a step on a started generation, starting it again when it dies under a restore."""
        ...


@dataclass(frozen=True)
class NextGeneration:
    plan: ReloadPlan
    config: Config
    launch: Launch
    overlap: bool
    overlap_why: str
    asked_ctx: int | None = None  # the -c asked for: the config's after a body's edits, else the fit's
    before_ctx: str | None = None  # the -c the previous generation ran with
    cut: bool = True  # answers still in flight at the drain's deadline are cut; else the reload is given up
    carries_streams: bool = False  # streams in flight are paused, to go on on the new server (not waited for)


def carries_streams(keeps_before: bool, keeps_after: bool, before: list[str], after: list[str]) -> bool:
    """Whether a reload from argv `before` to `after` hands streams in flight over (cut, their slots saved and
    restored, continued on the new server: a pause of the reload's downtime) rather than waiting for them: when a
    built-in carries conversations across on both sides (`keeps_…`), and each slot holds at least as much as
    before (what a stream holds fits there): as many slots, as much context, the same KV layout."""
    if not (keeps_before and keeps_after):
        return False
    try:
        old_ctx, new_ctx = int(args.get(before, args.CTX_SIZE) or 0), int(args.get(after, args.CTX_SIZE) or 0)
        old_np, new_np = int(args.get(before, args.PARALLEL) or 1), int(args.get(after, args.PARALLEL) or 1)
    except ValueError:
        return False
    same_kv = args.unified_kv(before) is args.unified_kv(after)
    return same_kv and old_ctx > 0 and new_ctx >= old_ctx and new_np == old_np


class Reloader:
    def __init__(self, host: ReloadHost) -> None:
        self.host = host
        self.handed = 0  # streams the run handed over to the new server

    def settle(self, body: dict[str, Any], why: str | None = None,
                asks: Asks | None = None, cut: bool = True) -> NextGeneration:
        """Check the request and settle the new generation's argv; ReloadRefused before anything stops.
        `why` (a built-in's reload, empty body): the built-ins' fit for the new generation is the change; not
        `cut`: answers in flight at the drain's deadline are not cut, the reload is given up instead."""
        current = self.host.current
        config = current.config
        if why is not None and not body:
            reload_plan = ReloadPlan(list(config.argv))
        else:
            try:
                reload_plan = plan(config.argv, body, flag_arity(config.argv[0]))
            except ReloadRefused as exc:
                reworded = _said_unchanged(exc, current) if "n_ctx" in body else None
                if reworded is None:
                    raise
                raise reworded from exc
        new_config = replace(config, argv=tuple(reload_plan.argv)).with_settings(reload_plan.settings)
        try:
            launch = replace(built_ins.launch_for(new_config, current.shared, asks), listen=current.launch.listen)
        except ConfigError as exc:
            raise ReloadRefused(str(exc)) from exc
        expected = expected_context(launch.argv, training_context(launch))
        unchanged = _same_server(current.launch.argv, launch.argv, expected)
        asked = asked_context(launch.argv if why is not None else new_config.argv)
        if why is not None:
            reload_plan.changes = [why, *_argv_changes(current.launch.argv, launch.argv)]
            if unchanged:
                raise ReloadRefused(f"nothing to change ({why})", 409, Refusal.NOTHING_TO_CHANGE)
        elif unchanged and not reload_plan.settings:
            story = _Story.of(asked, expected, launch)
            said = (f"n_ctx {asked} would run {story.runs} ({story.reason}), which is what runs now" if story
                    else "the new command line is the one that runs now")
            raise ReloadRefused(f"nothing to change: {said}", reason=Refusal.NOTHING_TO_CHANGE)
        overlap, overlap_why = self._overlap(config, launch)
        return NextGeneration(reload_plan, new_config, launch, overlap, overlap_why, asked,
                              args.get(current.launch.argv, args.CTX_SIZE), cut,
                              overlap and carries_streams(built_ins.keeps_conversations(current.config),
                                                          built_ins.keeps_conversations(new_config),
                                                          current.launch.argv, launch.argv))

    def _overlap(self, config: Config, launch: Launch) -> tuple[bool, str]:
        policy = config.reload_overlap
        if policy != "auto":
            return policy == "always", f"reload.overlap is {policy}"
        if args.offloaded(launch.argv):
            return False, "weights offloaded to a GPU would be loaded twice (-ngl): one server at a time"
        model_bytes = Path(launch.model.path).stat().st_size if launch.model.path else 0
        available = mem_available()
        if available is None:
            return False, "available memory unknown"
        fits = available > OVERLAP_MEMORY_FACTOR * model_bytes
        return fits, (f"{available / 2**30:.1f} GiB available, model file {model_bytes / 2**30:.2f} GiB "
                      f"({'enough' if fits else 'not enough'} for two servers side by side on CPU)")

    async def run(self, nxt: NextGeneration) -> dict[str, Any]:
        host = self.host
        old = host.current
        log.info("reload.begin", changes=nxt.plan.changes, overlap=nxt.overlap, why=nxt.overlap_why,
                 argv=nxt.launch.shown_argv)
        new = host.new_generation(nxt.config, nxt.launch)
        try:
            if nxt.overlap:  # blue-green: the old server keeps serving while the new one loads
                PROGRESS.begin("reloading: loading the new llama-server beside the old one")
                try:
                    await new.start(built_ins.server_output)
                except Exception as exc:  # nothing was disturbed: the old server never stopped serving
                    return await self._roll_back(nxt, old, None, str(exc))
            began = time.monotonic()
            host.hold()  # the gate holds new requests from here: the downtime begins
            if nxt.carries_streams and (handed := host.carry_streams()):  # paused: they go on once the new one serves
                self.handed = handed
                log.info("reload.handed_over", streams=handed)
            PROGRESS.begin("reloading: draining")
            if not await host.drain(old.config.reload_drain_timeout, nxt.cut):
                return await self._given_up(nxt, old, began)
            drain_ms = round((time.monotonic() - began) * 1000, 1)
            PROGRESS.begin("reloading: saving slots")
            saved = await built_ins.hand_over(old)
            if not nxt.overlap:
                await old.stop()
                PROGRESS.begin("reloading: loading the new llama-server")
                try:
                    await new.start(built_ins.server_output)
                except Exception as exc:  # StartFailed, or a bug: either way the previous server comes back
                    return await self._roll_back(nxt, old, began, str(exc))
            host.install(new)
            PROGRESS.begin("reloading: restoring slots")
            restored = await self._take_over(new)
            host.release()  # the held requests go to the new server
            downtime_ms = round((time.monotonic() - began) * 1000, 1)
            if nxt.overlap:
                await old.stop()
        finally:  # also when a SIGTERM cancels the reload: a new server that did not take over is stopped
            PROGRESS.end()
            if new is not host.current and new.alive:
                await new.stop()
        return await self._answer(nxt, True, "reloaded", downtime_ms, saved, restored, new, drain_ms)

    async def _take_over(self, generation: Generation) -> str | None:
        """The built-ins' restore into the new generation, surviving a server that dies under it."""
        return await self.host.survived(generation, lambda: built_ins.take_over(generation))

    async def _given_up(self, nxt: NextGeneration, old: Generation, began: float) -> dict[str, Any]:
        """A reload that may cut nothing, whose requests in flight did not finish within reload.drain_timeout:
        nothing stopped, the held requests go on to the server that ran."""
        reason = (f"requests in flight did not finish within reload.drain_timeout "
                  f"({old.config.reload_drain_timeout:g}s), and this reload cuts none")
        held_ms = round((time.monotonic() - began) * 1000, 1)  # new requests waited for the drain meanwhile
        log.info("reload.given_up", reason=reason, held_ms=held_ms)
        self.host.release()
        return await self._answer(nxt, False, f"reload given up: {reason}", held_ms, None, None, old, held_ms)

    async def _roll_back(self, nxt: NextGeneration, old: Generation, began: float | None,
                         reason: str) -> dict[str, Any]:
        """`began` is None when the new server failed before anything was held (overlap): nothing to undo."""
        host = self.host
        log.warning("reload.failed", reason=reason, overlap=nxt.overlap)
        if began is not None:
            try:
                await old.start(built_ins.server_output)
            except Exception as exc:  # nothing is left to serve with: the supervisor sees the dead server and
                log.error("reload.rollback_failed", error=str(exc))  # stops, the slots already saved
                raise
            host.install(old)
            await self._take_over(old)
            host.release()
        downtime_ms = round((time.monotonic() - began) * 1000, 1) if began is not None else 0.0
        return await self._answer(nxt, False, f"reload failed, the previous settings are back: {reason}",
                                  downtime_ms, None, None, host.current)

    async def _answer(self, nxt: NextGeneration, success: bool, message: str, downtime_ms: float,
                      saved: str | None, restored: str | None, generation: Generation,
                      drain_ms: float = 0.0) -> dict[str, Any]:
        context = generation.context
        if context is not None:
            n_ctx = context.slot
        else:
            try:
                props = await generation.props()
                n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 0)
            except LlamaError:
                n_ctx = 0
        changes = list(nxt.plan.changes)
        story = _Story.of(nxt.asked_ctx, context, generation.launch) if success else None
        if story is not None and (told := _told(changes, story, nxt.before_ctx)) is not None:
            changes = told
            message += f" ({story.message})"
        if not built_ins.keeps_conversations(nxt.config):
            message += " (no slots.save/slots.restore hooks: conversations are prefilled again)"
        answer = {
            "success": success, "n_ctx": n_ctx, "message": message, "downtime_ms": downtime_ms,
            "drain_ms": drain_ms, "handed_over": self.handed, "overlap": nxt.overlap, "overlap_why": nxt.overlap_why,
            "changes": changes,
            "context": ({**context.as_dict(), "asked": nxt.asked_ctx, "why": story.why if story else None}
                        if success and context is not None else None),
            "save": saved, "restore": restored, "slots": built_ins.restore_report(generation) if success else [],
        }
        log.info("reload.done", **{k: v for k, v in answer.items() if k != "slots"})
        METRICS.reloads.labels(outcome="success" if success else "rolled_back").inc()
        if success:
            METRICS.reload_downtime.observe(downtime_ms / 1000)
        return answer


def _argv_changes(old: list[str], new: list[str]) -> list[str]:
    """What differs between two generations' command lines, flag by flag (`-c 2048 -> 3584`), the port aside."""
    before, after = _options(args.remove(old, args.PORT)), _options(args.remove(new, args.PORT))
    changes = [f"{flag} {before.get(flag) or 'on'} -> {after[flag] or 'on'}" if flag in before
               else f"{flag}{' ' + after[flag] if after[flag] else ''} added"
               for flag in after if before.get(flag, "\0") != after[flag]]
    return changes + [f"{flag} removed" for flag in before if flag not in after]


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and not arg.lstrip("-").replace(".", "").isdigit()  # -1 is a value


def _options(argv: list[str]) -> dict[str, str]:
    """Each flag of a command line with the value that follows it ("" for a switch); the last one wins."""
    found: dict[str, str] = {}
    for index, arg in enumerate(argv[1:], start=1):
        if _is_flag(arg):
            name, eq, inline = arg.partition("=")
            following = argv[index + 1] if index + 1 < len(argv) else ""
            found[name] = inline if eq else following if following and not _is_flag(following) else ""
    return found


@dataclass(frozen=True)
class _Story:
    """How the -c asked for relates to what a server runs (or will): capped, rounded, or shared by slots."""

    asked: int
    runs: int
    slot: int
    slots: int
    why: str
    shared: bool  # `runs` is what was asked, shared by the slots, each with less (capped)
    capped: bool  # a slot has less than its share of what was asked

    @staticmethod
    def of(asked: int | None, context: ServerContext | None, launch: Launch) -> _Story | None:
        """None when it runs as asked (or either is unknown). `context.asked` is the -c the server was given,
        which a built-in's fit (degrade) may have made other than `asked`."""
        if asked is None or context is None:
            return None
        capped = context.slot < share(asked, context.slots, context.unified)
        if context.runs == asked and not capped:
            return None
        train = training_context(launch)
        if capped and train is not None and context.slot == train:
            why = TRAINING_CONTEXT
        elif context.asked is not None and context.asked != asked:
            why = _fit_why(launch) or f"a built-in's fit gave llama-server -c {context.asked}"
        else:
            why = context.why or "as llama-server reports it (GET /props)"
        shared = context.runs == asked and context.slots > 1 and context.unified
        if context.runs == asked and not shared:
            return None
        return _Story(asked, context.runs, context.slot, context.slots, why, shared, capped)

    @property
    def reason(self) -> str:
        """`why`, with the slots' cap when there are several (and it is not said otherwise)."""
        if self.capped and self.slots > 1 and not self.shared:
            return f"{self.slots} slots of at most {self.slot}, {self.why}"
        return self.why

    @property
    def suffix(self) -> str:
        """Added to the -c entry of `changes`."""
        if self.shared:
            return f"({self.slots} slots share {self.runs}, each at most {self.slot}: {self.why})"
        return f"(asked {self.asked}, runs {self.runs}: {self.reason})"

    @property
    def message(self) -> str:
        if self.shared:
            return (f"n_ctx {self.runs} is shared by {self.slots} slots, each conversation at most {self.slot}: "
                    f"{self.why}")
        return f"asked n_ctx {self.asked}, llama-server runs {self.runs}: {self.reason}"


def _told(changes: list[str], story: _Story, before: str | None) -> list[str] | None:
    """`changes` with the -c entry saying what runs, or one added when only the context that runs changed;
    None when the context is not news (neither asked for nor changed)."""
    for index, change in enumerate(changes):
        if change.startswith(tuple(f"{name} " for name in args.CTX_SIZE)):
            name, _, rest = change.partition(" ")
            if before and rest.startswith("(unset) -> "):  # the user's argv had none: the one that ran is news
                change = f"{name} {before} -> {rest.removeprefix('(unset) -> ')}"
            return [*changes[:index], f"{change} {story.suffix}", *changes[index + 1:]]
    if before != str(story.runs):
        return [*changes, f"-c {before or '(unset)'} -> {story.runs} {story.suffix}"]
    return None


def _fit_why(launch: Launch) -> str | None:
    """What a built-in's fit said of the -c it chose (the last note that names one)."""
    for note in reversed(launch.notes):
        change = note.get("change", "")
        if change.startswith("-c ") and " -> " in change and "GET /props" in note.get("why", ""):
            continue  # the wrapper's own record of what the server runs
        if "-c " in change:
            return f"{change.split(', -c ')[0]}: {note.get('why', '')}"
    return None


def _same_server(old: list[str], new: list[str], expected: ServerContext | None) -> bool:
    """Whether `new` runs what `old` runs now (the port aside): the same flags, and a -c that runs the same
    (`expected`: what llama-server will make of the new -c)."""
    if expected is not None and expected.asked is not None and expected.runs != expected.asked:
        new = with_context(new, expected.runs)

    def key(argv: list[str]) -> tuple[list[tuple[str, str]], str | None]:
        rest = args.remove(args.remove(argv, args.PORT), args.CTX_SIZE)
        flags = []  # every occurrence with its value, wherever it stands
        for index in range(1, len(rest)):
            if _is_flag(rest[index]):
                flags.append(next(iter(_options([rest[0], *rest[index:index + 2]]).items())))
        return sorted(flags), args.get(argv, args.CTX_SIZE)

    return key(old) == key(new)


def _said_unchanged(refused: ReloadRefused, current: Generation) -> ReloadRefused | None:
    """The plan's "nothing to change", saying what runs when the -c asked is the one given already (None
    when that is nothing to add)."""
    asked = asked_context(current.config.argv)
    story = _Story.of(asked, current.context, current.launch)
    if refused.reason is not Refusal.NOTHING_TO_CHANGE or story is None:
        return None
    runs = (f"{story.slots} slots share it, each at most {story.slot}: {story.why}" if story.shared else
            f"llama-server runs {story.runs}: {story.reason}")
    return ReloadRefused(f"nothing to change: -c is {asked} already ({runs})", refused.status, refused.reason)
