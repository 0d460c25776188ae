"""Every built-in, declared in one place: its actions, what it adds to the child's argv, what it watches in
proxied responses, what it reports in status, and what it does when a generation is replaced.

The wrapper reads this table through wrapper/extensions.py and nowhere else; the built-ins use only the
wrapper's public modules (runtime, launch, config, llama, proxy, argv, model, gguf_meta, server_help).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from hooks import degrade, plan_cli, server_reload, slots, slots_cli
from hooks.fitting import fit_for_slots
from wrapper.config import Config
from wrapper.generation import Generation, Host
from wrapper.launch import Fitting, Launch
from wrapper.proxy import Observer

Options = Mapping[str, Any]
ActionFn = Callable[[Generation, Options], Awaitable[str | None]]


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
    actions: Mapping[str, BuiltinAction] = field(default_factory=dict)
    in_use: Callable[[Config], bool] | None = None  # otherwise: a hook names one of its actions
    fit: Callable[[list[str], Launch, Config, dict[str, Any]], Fitting] | None = None  # argv changes
    observer: Callable[[Generation], Observer | None] | None = None  # watches proxied responses
    status: Callable[[Generation], dict[str, Any]] | None = None  # its part of /wrapper/status
    hand_over: Callable[[Generation], Awaitable[str]] | None = None  # the old generation, before a reload
    take_over: Callable[[Generation], Awaitable[str]] | None = None  # the new generation, before it serves
    server_line: Callable[[Generation, str], bool] | None = None  # False: log the line at debug level only
    background: Callable[[Host], Coroutine[Any, Any, None]] | None = None  # runs from ready until the stop
    grow: Callable[[Host, int, bool], Awaitable[str | None]] | None = None  # a request needs this many tokens
    routes: tuple[Route, ...] = ()
    commands: tuple[click.Command, ...] = ()  # its `llama-wrapper` subcommands


BUILTINS: tuple[Builtin, ...] = (
    Builtin(
        family=slots.FAMILY,
        actions={"slots.save": BuiltinAction(lambda rt, _: slots.save(rt), doc="save every slot that holds tokens"),
                 "slots.restore": BuiltinAction(lambda rt, _: slots.restore(rt),
                                                doc="restore the saved slots the server can use")},
        fit=lambda argv, launch, config, _: fit_for_slots(argv, launch, config),
        observer=slots.observer, status=slots.status,
        hand_over=slots.save_step, take_over=slots.take_over, commands=(slots_cli.slots,),
    ),
    Builtin(
        family="server",
        actions={"server.reload": BuiltinAction(server_reload.run, server_reload.check,
                                                doc="reconfigure a wrapper's llama-server (POST /wrapper/reload)")},
    ),
    Builtin(
        family=degrade.FAMILY, in_use=degrade.in_use, fit=degrade.fit, observer=degrade.observer,
        status=degrade.status, server_line=degrade.server_line, background=degrade.relax, grow=degrade.grow,
        routes=(Route("GET", "/wrapper/memory", degrade.memory_route, degrade.TURN_ON),
                Route("POST", "/wrapper/budget", degrade.set_budget, degrade.TURN_ON)),
        commands=(plan_cli.plan,),
    ),
)
ACTIONS: dict[str, BuiltinAction] = {name: action for b in BUILTINS for name, action in b.actions.items()}
