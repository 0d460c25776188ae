"""The one place the wrapper meets its built-ins (hooks/registry.py): names, options, argv changes, observers,
status and the reload hand-over, each asked of every built-in a config uses."""

from __future__ import annotations

import difflib
import os
from collections.abc import Coroutine, Mapping
from dataclasses import replace
from typing import Any

import click

from hooks.registry import ACTIONS, BUILTINS, Builtin, Route
from wrapper.actions import BuiltinFn
from wrapper.config import Config, ConfigError, load_config
from wrapper.generation import Generation, Host
from wrapper.launch import Launch
from wrapper.launch import prepare as prepare_launch
from wrapper.proxy import Observer


def load(path: str | os.PathLike[str]) -> Config:
    """Read a config and check its built-in actions and their options; ConfigError names every problem."""
    config = load_config(path)
    if found := problems(config):
        raise ConfigError("\n".join(found))
    return config


def problems(config: Config) -> list[str]:
    found = []
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


_IN_USE: dict[int, tuple[Config, list[Builtin]]] = {}  # by config: asked on every proxied request


def in_use(config: Config) -> list[Builtin]:
    known = _IN_USE.get(id(config))
    if known is not None and known[0] is config:
        return known[1]
    found = [b for b in BUILTINS if (b.in_use(config) if b.in_use is not None else config.uses(b.family))]
    if len(_IN_USE) > 64:  # configs of generations long gone
        _IN_USE.clear()
    _IN_USE[id(config)] = (config, found)
    return found


def prepare(config: Config, shared: dict[str, Any]) -> Launch:
    """The child's command line: the wrapper's own changes, then each built-in's in turn, every one noted.
    `shared`: the built-ins' lifelong state (the supervisor's), which their choices may depend on."""
    launch = prepare_launch(config)
    argv, notes, prepared = list(launch.argv), list(launch.notes), dict(launch.prepared)
    for builtin in in_use(config):
        if builtin.fit is not None:
            fit = builtin.fit(argv, replace(launch, argv=argv, prepared=dict(prepared)), config, shared)
            argv, prepared[builtin.family] = fit.argv, fit.prepared
            notes += fit.notes
    return replace(launch, argv=argv, notes=notes, prepared=prepared)


def bind(name: str, options: Mapping[str, Any], runtime: Generation) -> BuiltinFn:
    action = ACTIONS[name]
    return lambda: action.run(runtime, options)


def observer(runtime: Generation) -> Observer | None:
    """What watches proxied responses now; None when no built-in has anything to learn from them."""
    watching = [o for b in in_use(runtime.config) if b.observer and (o := b.observer(runtime)) is not None]
    if len(watching) <= 1:
        return watching[0] if watching else None

    def every(path: str, status: int, tail: bytes) -> None:
        for watch in watching:
            watch(path, status, tail)

    return every


def status(runtime: Generation) -> dict[str, Any]:
    return {b.family: b.status(runtime) for b in in_use(runtime.config) if b.status is not None}


async def hand_over(runtime: Generation) -> str | None:
    """Before a reload replaces the generation (slots: save); None when no built-in has anything to do."""
    done = [await b.hand_over(runtime) for b in in_use(runtime.config) if b.hand_over is not None]
    return "; ".join(done) if done else None


async def take_over(runtime: Generation) -> str | None:
    """Into the new generation before it serves (slots: restore, prefill what cannot be restored)."""
    done = [await b.take_over(runtime) for b in in_use(runtime.config) if b.take_over is not None]
    return "; ".join(done) if done else None


def server_line(runtime: Generation, line: str) -> bool:
    """Show one line of llama-server's output to the built-ins; False when every one says it is only noise."""
    shown = [b.server_line(runtime, line) for b in in_use(runtime.config) if b.server_line is not None]
    return all(shown)


def background(host: Host) -> list[Coroutine[Any, Any, None]]:
    """The built-ins' work from ready until the stop (degrade: relax when idle)."""
    return [b.background(host) for b in in_use(host.current.config) if b.background is not None]


async def grow(host: Host, needed: int, pool_full: bool = False) -> str | None:
    """A request needs `needed` tokens of context (`pool_full`: the slots' shared KV ran out): None once a
    built-in made room (send it again), else why not; without such a built-in, the overflow stands."""
    growers = [b.grow for b in in_use(host.current.config) if b.grow is not None]
    if not growers:
        return ""
    return await growers[0](host, needed, pool_full)


def growing(config: Config) -> bool:
    return any(b.grow is not None for b in in_use(config))


def routes(config: Config) -> list[Route]:
    return [route for b in in_use(config) for route in b.routes]


def all_routes() -> list[Route]:
    """Every built-in's endpoints, in use or not (those not in use answer that they are off)."""
    return [route for b in BUILTINS for route in b.routes]


def commands() -> list[click.Command]:
    return [command for b in BUILTINS for command in b.commands]
