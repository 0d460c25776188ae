"""The one place the wrapper meets its built-ins (hooks/registry.py): sections, names, options, argv changes,
request steps, observers, status and the reload hand-over, each asked of every built-in a config uses."""

from __future__ import annotations

import difflib
import os
from collections.abc import Coroutine, Mapping
from dataclasses import replace
from typing import Any

import structlog

from hooks.registry import ACTIONS, BUILTINS, Builtin, why_not_kept
from hooks.registry import SECTIONS as BUILTIN_SECTIONS
from hooks.registry import Route as Route  # the wrapper's endpoints serve the built-ins' routes
from wrapper.actions import ActionError, BuiltinFn
from wrapper.configuration import consumers
from wrapper.configuration.config import Config, load_config, parse_config
from wrapper.configuration.consumers import CONSUMERS
from wrapper.configuration.sections import PRIORITY, ROUTER, SLEEP, WATCHDOG, router_clashes
from wrapper.configuration.settings import Section
from wrapper.kept import Kept, Key
from wrapper.launching.flags import supported_flags
from wrapper.launching.launch import Asks, Launch
from wrapper.launching.launch import prepare as prepare_launch
from wrapper.queue import priority
from wrapper.server.generation import Generation, Host, ServerLeaving
from wrapper.server.output import server_output_level
from wrapper.steps import Before, Growth, Observer, Shown

log = structlog.get_logger()

# the wrapper's own, then the built-ins'
SECTIONS: tuple[Section[Any], ...] = (WATCHDOG, PRIORITY, SLEEP, ROUTER, CONSUMERS, *BUILTIN_SECTIONS)


def load(path: str | os.PathLike[str] | None) -> Config:
    """Read a config with every built-in's section and check its built-in actions and their options;
    ConfigError names every problem. None: every default."""
    return load_config(path, SECTIONS, problems) if path is not None else parse_config("", "<defaults>", SECTIONS)


def parse(text: str, name: str = "<config>") -> Config:
    return parse_config(text, name, SECTIONS, problems)


def sections() -> tuple[Section[Any], ...]:
    return SECTIONS


def problems(config: Config) -> list[str]:
    found = [f"{config.source or '<config>'}: {clash}" for clash in router_clashes(ROUTER.of(config))]
    found += [f"{config.source or '<config>'}: {problem}" for problem in consumers.problems(CONSUMERS.of(config))]
    for action in config.all_actions():
        if action.kind != "builtin":
            continue
        known = ACTIONS.get(action.builtin)
        if known is None:
            hint = difflib.get_close_matches(action.builtin, list(ACTIONS), n=1)
            found.append(f"{action.where}: unknown built-in {action.builtin!r}"
                         + (f" (did you mean {hint[0]!r}?)" if hint else f" (known: {', '.join(ACTIONS)})"))
        else:
            found += [f"{action.where}: {action.builtin}: {problem}" for problem in known.check(action.options)]
    return found


def uses(config: Config) -> list[Builtin]:
    """The built-ins a config uses, in their declared order (hooks/registry.py's `after`)."""
    return [b for b in BUILTINS if (b.in_use(config) if b.in_use is not None else config.uses(b.family))]


_IN_USE: Key[list[Builtin]] = Key("builtins.in_use", list)


def in_use(generation: Generation) -> list[Builtin]:
    """The built-ins a generation uses: settled once, when it is first asked."""
    return generation.state.settle(_IN_USE, lambda: uses(generation.config))


def warnings(config: Config) -> list[str]:
    """What the built-ins a config uses say works but is probably not meant (`check`, and the start's log)."""
    found = [w for b in uses(config) if b.warnings is not None for w in b.warnings(config)]
    if PRIORITY.of(config).preempt is True and not keeps_paused(config):
        found.append(f"priority.preempt is true, but it is off: {why_not_kept(config)}")
    sleep = SLEEP.of(config)
    if (sleep.after is not None or sleep.when_asked is not None) and not config.uses("slots"):
        found.append("sleep is on, but no slot built-in keeps the conversations: each wake prefills them again "
                     "(name slots.save in on_will_stop and slots.restore in on_startup)")
    return found


def checked(config: Config, probe: bool) -> dict[str, Any]:
    """What `check` says of what a config names outside it (an object store), `probe`: tried."""
    found: dict[str, Any] = {}
    for builtin in BUILTINS:
        if builtin.checked is not None and (said := builtin.checked(config, probe)):
            found.update(said)
    return found


def launch_for(config: Config, shared: Kept, asks: Asks | None = None) -> Launch:
    """The child's command line: the wrapper's own changes, then each built-in's in turn, every one noted.
    `shared`: the built-ins' lifelong state (what serves keeps it); `asks`: what a built-in's move asks the next
    fits for (by type: hooks/asks.py)."""
    launch = prepare_launch(config)
    argv, notes, fitted = list(launch.argv), list(launch.notes), dict(launch.fitted)
    flags = supported_flags(argv[0])
    kvu = flags is None or "-kvu" in flags
    fitted[LANE], fitted[LANE_WHY_KEY] = priority.lane(PRIORITY.of(config), argv, kvu and config.uses("slots"))
    if fitted[LANE]:  # first: the fits (degrade's plan) size the server it makes
        argv, added = priority.with_lane(argv, kvu)
        notes += added
    keep_saved = launch.keep_saved
    for builtin in uses(config):
        if builtin.fit is not None:
            fit = builtin.fit(argv, replace(launch, argv=argv, fitted=dict(fitted)), config, shared, asks or {})
            argv, fitted[builtin.family] = fit.argv, fit.fitted
            notes += fit.notes
            keep_saved = keep_saved or fit.keep_saved
    return replace(launch, argv=argv, notes=notes, fitted=fitted, keep_saved=keep_saved)


LANE, LANE_WHY_KEY = "priority.lane", "priority.lane.why"  # in Launch.fitted: whether a slot is kept for people


def lane_of(launch: Launch) -> tuple[bool, str]:
    """Whether the launch keeps a slot for interactive requests (priority.lane), and why."""
    return bool(launch.fitted.get(LANE)), str(launch.fitted.get(LANE_WHY_KEY) or "")


def bind(name: str, options: Mapping[str, Any], generation: Generation) -> BuiltinFn:
    action = ACTIONS[name]

    async def run() -> str | None:
        try:
            return await generation.while_it_stays(action.run(generation, options))
        except ServerLeaving as exc:
            raise ActionError(str(exc)) from exc
    return run


def observer(generation: Generation) -> Observer | None:
    """What watches proxied responses now; None when no built-in has anything to learn from them."""
    watching = [o for b in in_use(generation) if b.observer and (o := b.observer(generation)) is not None]
    if len(watching) <= 1:
        return watching[0] if watching else None

    def every(path: str, status: int, tail: bytes) -> None:
        for watch in watching:
            watch(path, status, tail)

    return every


def families_off(generation: Generation) -> tuple[str, ...]:
    """The metric families of the features this generation's config leaves off (not shown in /metrics)."""
    config, used = generation.config, in_use(generation)
    off = [prefix for b in BUILTINS if b not in used for prefix in b.families]
    off += [prefix for b in used if b.families_off is not None for prefix in b.families_off(config)]
    sleep = SLEEP.of(config)
    if sleep.after is None and sleep.when_asked is None:
        off.append("llama_wrapper_asleep")
    if not consumers.on(CONSUMERS.of(config)):
        off.append("llama_wrapper_consumer_")
    return tuple(off)


def refresh_metrics(generation: Generation) -> None:
    """Each built-in sets its gauges before a scrape."""
    for builtin in in_use(generation):
        if builtin.metrics is not None:
            builtin.metrics(generation)


def held_tokens(generation: Generation, running: Mapping[int, int]) -> int | None:
    """The tokens the slots hold, as the built-in that tracks them knows (None: none does); `running`: slot -> the
    tokens of the request running there, as far as a step counted them."""
    for builtin in in_use(generation):
        if builtin.held is not None:
            return builtin.held(generation, running)
    return None


def status(generation: Generation) -> dict[str, Any]:
    return {b.family: b.status(generation) for b in in_use(generation) if b.status is not None}


async def hand_over(generation: Generation) -> str | None:
    """Before a reload replaces the generation (slots: save); None when no built-in has anything to do."""
    done = [await b.hand_over(generation) for b in in_use(generation) if b.hand_over is not None]
    return "; ".join(done) if done else None


async def take_over(generation: Generation) -> str | None:
    """Into the new generation before it serves (slots: restore, prefill what cannot be restored)."""
    done = [await b.take_over(generation) for b in in_use(generation) if b.take_over is not None]
    return "; ".join(done) if done else None


def slept(generation: Generation, asleep: bool) -> None:
    """llama-server stopped for a sleep (`asleep`: a pool member's share is 0 from now), or is about to start at a
    wake (its next fit takes what it needs as at a start)."""
    for builtin in in_use(generation):
        if builtin.sleep is not None:
            builtin.sleep(generation, asleep)


def keeps_paused(config: Config) -> bool:
    """Whether a built-in keeps what a paused request's slot holds (the conversation cache): preemption."""
    return any(b.keeps_paused for b in uses(config))


QUEUE_ONLY = "interactive requests still go first in the queue"


def preemption(config: Config) -> tuple[bool, str]:
    """Whether background generations are paused for interactive requests, and why (`priority.preempt`, where
    `auto` is on when a built-in keeps what a paused slot holds: the conversation cache)."""
    settings = PRIORITY.of(config)
    if settings.preempt is False:
        return False, f"priority.preempt is false: nothing is paused; {QUEUE_ONLY}"
    if settings.max_pauses == 0:
        return False, f"priority.max_pauses is 0: nothing is paused; {QUEUE_ONLY}"
    if not keeps_paused(config):
        return False, f"{why_not_kept(config)}; {QUEUE_ONLY}"
    return True, f"a background generation yields its slot to an interactive request, at most priority.max_pauses " \
                 f"({settings.max_pauses}) times"


def keeps_conversations(config: Config) -> bool:
    """Whether a built-in carries conversations across a reload."""
    return any(b.take_over is not None for b in uses(config))


def restore_report(generation: Generation) -> list[dict[str, Any]]:
    return [entry for b in in_use(generation) if b.reload_report is not None
            for entry in b.reload_report(generation)]


def server_line(generation: Generation, line: str) -> bool:
    """Show one line of llama-server's output to the built-ins; False when every one says it is only noise."""
    shown = [b.server_line(generation, line) for b in in_use(generation) if b.server_line is not None]
    return all(shown)


def server_output(generation: Generation, line: str) -> None:
    """Log one line of llama-server's output, at the level its text and the built-ins give it."""
    log.log(server_output_level(line, server_line(generation, line)), "server.output", line=line)


def background(host: Host) -> list[Coroutine[Any, Any, None]]:
    """The built-ins' work from ready until the stop (degrade: relax when idle)."""
    return [b.background(host) for b in in_use(host.current) if b.background is not None]


def growth(generation: Generation) -> Growth | None:
    """The built-in that grows the context for a request that overflows it, if one is in use."""
    return next((b.growth for b in in_use(generation) if b.growth is not None), None)


def shown(generation: Generation, path: str) -> list[Shown]:
    """What rewrites llama-server's answer to a GET of `path` now (what clients are told of the server)."""
    return [b.shown for b in in_use(generation) if b.shown is not None and path in b.shown.paths
            and b.shown.applies(generation)]


def before(generation: Generation) -> list[Before]:
    """The steps a request takes before it is forwarded."""
    return [step for b in in_use(generation) for step in b.before]


def routes(generation: Generation) -> list[Route]:
    return [route for b in in_use(generation) for route in b.routes]


def all_routes() -> list[Route]:
    """Every built-in's endpoints, in use or not (those not in use answer that they are off)."""
    return [route for b in BUILTINS for route in b.routes]
