"""Every built-in, declared in one place: its actions, what it adds to the child's argv, what it watches in
proxied responses, what it reports in status, and what it does when a generation is replaced.

The wrapper reads this table through wrapper/extensions.py and nowhere else; the built-ins use only the
wrapper's public modules (runtime, launch, config, llama, proxy, argv, model, gguf_meta, server_help).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import click

from hooks import server_reload, slots, slots_cli
from hooks.fitting import fit_for_slots
from wrapper.config import Config
from wrapper.launch import Fitting, Launch
from wrapper.proxy import Observer
from wrapper.runtime import Runtime

Options = Mapping[str, Any]
ActionFn = Callable[[Runtime, Options], Awaitable[str | None]]


def _no_options(options: Options) -> list[str]:
    return [f"takes no options (got {', '.join(options)})"] if options else []


@dataclass(frozen=True)
class BuiltinAction:
    run: ActionFn
    check: Callable[[Options], list[str]] = _no_options  # problems with its `with:` options, at load
    doc: str = ""


@dataclass(frozen=True)
class Builtin:
    family: str  # actions are named `<family>.<verb>`; the built-in is in use when a hook names one
    actions: Mapping[str, BuiltinAction]
    fit: Callable[[list[str], Launch, Config], Fitting] | None = None  # its argv changes, when in use
    observer: Callable[[Runtime], Observer | None] | None = None  # watches proxied responses
    status: Callable[[Runtime], dict[str, Any]] | None = None  # its part of /wrapper/status
    hand_over: Callable[[Runtime], Awaitable[str]] | None = None  # the old generation, before a reload
    take_over: Callable[[Runtime], Awaitable[str]] | None = None  # the new generation, before it serves
    commands: tuple[click.Command, ...] = ()  # its `llama-wrapper` subcommands


BUILTINS: tuple[Builtin, ...] = (
    Builtin(
        family=slots.FAMILY,
        actions={"slots.save": BuiltinAction(lambda rt, _: slots.save(rt), doc="save every slot that holds tokens"),
                 "slots.restore": BuiltinAction(lambda rt, _: slots.restore(rt),
                                                doc="restore the saved slots the server can use")},
        fit=fit_for_slots, observer=slots.observer, status=slots.status,
        hand_over=slots.save_step, take_over=slots.take_over, commands=(slots_cli.slots,),
    ),
    Builtin(
        family="server",
        actions={"server.reload": BuiltinAction(server_reload.run, server_reload.check,
                                                doc="reconfigure a wrapper's llama-server (POST /wrapper/reload)")},
    ),
)
ACTIONS: dict[str, BuiltinAction] = {name: action for b in BUILTINS for name, action in b.actions.items()}
