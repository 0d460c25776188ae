"""Every built-in, declared in one place: its settings section, its actions, what it adds to the child's argv,
its steps on the request path, what it watches in proxied responses, what it reports in status, and what it
does when a generation is replaced. Its `llama-wrapper` subcommands are named in hooks/commands.py.

The wrapper reads this table through wrapper/extensions.py and nowhere else; the built-ins use only the
wrapper's core modules (the layers are declared in pyproject.toml and checked by `make lint`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from hooks import conversations, server_reload, slots
from hooks.degrade import FAMILY as DEGRADE_FAMILY
from hooks.degrade import TURN_ON, control, fit, report
from hooks.degrade.settings import DEGRADE
from hooks.fitting import fit_for_slots
from wrapper.config import Config
from wrapper.generation import Generation, Host
from wrapper.launch import Fitting, Launch
from wrapper.proxy import Observer
from wrapper.settings import Section
from wrapper.steps import Before, Growth

Options = Mapping[str, Any]
ActionFn = Callable[[Generation, Options], Awaitable[str | None]]
Fit = Callable[[list[str], Launch, Config, dict[str, Any], Mapping[str, Any]], Fitting]


def _no_options(options: Options) -> list[str]:
    return [f"takes no options (got {', '.join(options)})"] if options else []


@dataclass(frozen=True)
class BuiltinAction:
    run: ActionFn
    check: Callable[[Options], list[str]] = _no_options  # problems with its `with:` options, at load
    doc: str = ""


@dataclass(frozen=True)
class Route:
    """An endpoint a built-in adds: `POST` ones need the admin token, `GET` ones one of the API keys."""

    method: str
    path: str
    handler: Callable[[Host, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]
    off: str = ""  # how to turn it on, for the 409 it answers while its built-in is not in use


@dataclass(frozen=True)
class Builtin:
    family: str  # actions are named `<family>.<verb>`; by default in use when a hook names one
    settings: Section[Any] | None = None  # its section of the config, declared in its own module
    actions: Mapping[str, BuiltinAction] = field(default_factory=dict)
    in_use: Callable[[Config], bool] | None = None  # otherwise: a hook names one of its actions
    fit: Fit | None = None  # argv changes; `asks`: what a move of a built-in asks the next fit for
    before: tuple[Before, ...] = ()  # steps before a request is forwarded
    growth: Growth | None = None  # when llama-server answers a context overflow
    observer: Callable[[Generation], Observer | None] | None = None  # watches proxied responses
    status: Callable[[Generation], dict[str, Any]] | None = None  # its part of /wrapper/status
    metrics: Callable[[Generation], None] | None = None  # sets its gauges before a scrape of /metrics
    hand_over: Callable[[Generation], Awaitable[str]] | None = None  # the old generation, before a reload
    take_over: Callable[[Generation], Awaitable[str]] | None = None  # the new generation, before it serves
    reload_report: Callable[[Generation], list[dict[str, Any]]] | None = None  # per slot, in a reload's answer
    server_line: Callable[[Generation, str], bool] | None = None  # False: log the line at debug level only
    background: Callable[[Host], Coroutine[Any, Any, None]] | None = None  # runs from ready until the stop
    routes: tuple[Route, ...] = ()


BUILTINS: tuple[Builtin, ...] = (
    Builtin(
        family=slots.FAMILY, settings=slots.SLOTS,
        actions={"slots.save": BuiltinAction(lambda g, _: slots.save(g), doc="save every slot that holds tokens"),
                 "slots.restore": BuiltinAction(lambda g, _: slots.restore(g),
                                                doc="restore the saved slots the server can use")},
        fit=lambda argv, launch, config, _, __: fit_for_slots(argv, launch, config),
        observer=slots.observer,
        status=lambda g: {**slots.status(g), "conversations": conversations.status(g)},  # where status has had it
        hand_over=slots.save_step, take_over=slots.take_over,
        reload_report=slots.restore_report,
    ),
    Builtin(  # the conversation cache: on with the slot built-ins (its settings are `slots.cache*`)
        family=conversations.FAMILY, in_use=conversations.in_use,
        before=(Before(conversations.PATHS, conversations.before),),
        observer=conversations.observer, metrics=conversations.metrics,
    ),
    Builtin(
        family="server",
        actions={"server.reload": BuiltinAction(server_reload.run, server_reload.check,
                                                doc="reconfigure a wrapper's llama-server (POST /wrapper/reload)")},
    ),
    Builtin(  # after slots: its fit starts from the argv the slot built-ins made fit for persistence
        family=DEGRADE_FAMILY, settings=DEGRADE, in_use=lambda config: DEGRADE.on(config) is not None,
        fit=fit.fit, observer=report.observer, status=report.status, metrics=report.metrics,
        server_line=report.server_line,
        background=control.relax,
        growth=Growth(control.grow, lambda config: DEGRADE.of(config).continue_truncated,
                      lambda config: DEGRADE.of(config).headroom),
        routes=(Route("GET", "/wrapper/memory", report.memory_route, TURN_ON),
                Route("POST", "/wrapper/budget", control.set_budget, TURN_ON)),
    ),
)
ACTIONS: dict[str, BuiltinAction] = {name: action for b in BUILTINS for name, action in b.actions.items()}
SECTIONS: tuple[Section[Any], ...] = tuple(b.settings for b in BUILTINS if b.settings is not None)
