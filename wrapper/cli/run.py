"""`llama-wrapper run` and `llama-wrapper check`: the wrapper itself, and its config read as `run` reads it."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import structlog
import yaml

from wrapper import built_ins
from wrapper.cli import logs
from wrapper.configuration import consumers
from wrapper.configuration.auth import default_token_file
from wrapper.configuration.config import HOOK_EVENTS, Config, ConfigError, parse_listen
from wrapper.configuration.consumers import CONSUMERS
from wrapper.configuration.exits import EXIT_CONFIG, EXIT_FAILED
from wrapper.configuration.sections import PRIORITY
from wrapper.configuration.units import parse_duration
from wrapper.configuration.usage import RUN_EXAMPLES, SERVER_COMMAND_SETTINGS, ServerCommand
from wrapper.http.listener import serve
from wrapper.kept import Kept
from wrapper.life.supervisor import supervise
from wrapper.queue import priority

log = structlog.get_logger()


class _Duration(click.ParamType):  # type: ignore[type-arg]
    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()


@click.command(cls=ServerCommand, epilog=RUN_EXAMPLES, context_settings=SERVER_COMMAND_SETTINGS)
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="LLAMA_WRAPPER_CONFIG",
              show_envvar=True, help="YAML file: server, hooks and the other sections (slots, cache, store, watchdog, "
              "priority, degrade, ...; see docs/configuration.md).")
@click.option("--listen", envvar="LLAMA_WRAPPER_LISTEN", show_envvar=True, metavar="HOST:PORT",
              help="Public address [default: listen from the config, else llama-server's --host/--port, "
                   "else 127.0.0.1:8080].")
@click.option("--ready-timeout", type=DURATION, envvar="LLAMA_WRAPPER_READY_TIMEOUT", show_envvar=True,
              help="How long llama-server may take to load [default: 300s].")
@click.option("--stop-timeout", type=DURATION, envvar="LLAMA_WRAPPER_STOP_TIMEOUT", show_envvar=True,
              help="SIGKILL llama-server this long after its SIGTERM [default: 10s].")
@click.option("--slots-dir", type=click.Path(file_okay=False), envvar="LLAMA_WRAPPER_SLOTS_DIR",
              show_envvar=True, help="Where slot files are kept [default: ~/.cache/llama-wrapper/slots].")
@click.option("--log-format", type=click.Choice(["auto", "console", "json"]), default="auto",
              envvar="LLAMA_WRAPPER_LOG_FORMAT", show_envvar=True, show_default=True,
              help="auto: console on a terminal, JSON lines otherwise.")
@click.option("--log-level", type=click.Choice(logs.LEVELS), default="info", envvar="LLAMA_WRAPPER_LOG_LEVEL",
              show_envvar=True, show_default=True)
@click.argument("server_argv", nargs=-1, type=click.UNPROCESSED, metavar="-- LLAMA-SERVER [ARGS]...")
def run(config_path: str | None, listen: str | None, ready_timeout: float | None, stop_timeout: float | None,
        slots_dir: str | None, log_format: logs.LogFormat, log_level: str, server_argv: tuple[str, ...]) -> None:
    """Start llama-server behind the wrapper and supervise it until a signal stops it."""
    logs.configure(log_format, log_level)
    try:
        config = built_ins.load(config_path)
        changes: dict[str, Any] = {}
        if listen:
            try:
                changes["listen"] = parse_listen(listen)
            except ValueError as exc:
                raise ValueError(f"--listen: {exc}") from exc
        if ready_timeout is not None:
            changes["ready_timeout"] = ready_timeout
        if stop_timeout is not None:
            changes["stop_timeout"] = stop_timeout
        if server_argv:
            changes["argv"] = tuple(server_argv)
        config = replace(config, **changes)
        if slots_dir:
            config = config.with_settings({"slots": {"dir": Path(slots_dir).expanduser()}})
        shared = Kept()
        launch = built_ins.launch_for(config, shared)
    except (ConfigError, ValueError) as exc:
        click.echo(f"llama-wrapper: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    if config_path is None:
        log.info("wrapper.no_config", hint="no hooks run and nothing is saved: give --config hooks.yaml (e.g. "
                 "examples/chat.yaml: the slot built-ins keep the conversations across stops)")
    sys.exit(asyncio.run(supervise(config, launch, shared, serve)))


@click.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(dir_okay=False), required=False,
                envvar="LLAMA_WRAPPER_CONFIG")
@click.option("--probe", is_flag=True, help="Also try what the config names outside (the object store: one "
              "listing of its bucket); exit 1 when that fails.")
def check(config_path: str | None, probe: bool) -> None:
    """Validate CONFIG (default: $LLAMA_WRAPPER_CONFIG) and print the resolved settings and hooks (for an object
    store: its endpoint and where its credentials come from); starts nothing. Exit 2 on errors."""
    if not config_path:
        click.echo("llama-wrapper: check which config? give CONFIG, or set LLAMA_WRAPPER_CONFIG", err=True)
        sys.exit(EXIT_CONFIG)
    try:
        config = built_ins.load(config_path)
    except ConfigError as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_CONFIG)
    for warning in [*config.warnings, *built_ins.warnings(config)]:
        click.echo(f"warning: {warning}", err=True)
    outside = built_ins.checked(config, probe)
    click.echo(yaml.safe_dump({**_resolved(config), **({"reaches": outside} if outside else {})}, sort_keys=False,
                              width=110), nl=False)
    if probe and any(str(said.get("probe", "")).startswith("failed") for said in outside.values()):
        sys.exit(EXIT_FAILED)


def _lane(config: Config) -> dict[str, Any]:
    """Whether a slot is kept for interactive requests (priority.lane), as it would be for the config's argv."""
    if not config.argv:
        return {"enabled": "decided at the start, from the llama-server command's -np and -kvu"}
    on, why = priority.lane(PRIORITY.of(config), list(config.argv), config.uses("slots"))
    return {"enabled": on, "why": why}


def _isolation(config: Config) -> dict[str, Any]:
    """Whether each consumer is served only from what it kept (consumers.isolate, `auto` resolved)."""
    settings = CONSUMERS.of(config)
    on = consumers.isolating(settings)
    why = ("consumers.isolate is " + str(settings.isolate).lower()) if settings.isolate is not None else (
        f"auto: {len(settings.keys)} consumer(s) named, " + ("more than one" if on else "not more than one"))
    return {"enabled": on, "why": why}


def _resolved(config: Config) -> dict[str, Any]:
    hooks: dict[str, Any] = {}
    for event in HOOK_EVENTS:
        hooks[event] = [
            {k: v for k, v in {
                "name": a.name, "where": a.where, a.kind: _body(a), "timeout": f"{a.timeout:g}s",
                "retries": a.retries, "ignore_errors": a.ignore_errors, "when": a.when,
            }.items() if v is not None}
            for a in config.hooks[event]
        ]
    return {
        "listen": config.listen.url if config.listen else "llama-server's --host/--port, else 127.0.0.1:8080",
        "server": {"argv": list(config.argv) or "(after --)", "ready_timeout": f"{config.ready_timeout:g}s",
                   "stop_timeout": f"{config.stop_timeout:g}s", "drain_timeout": f"{config.drain_timeout:g}s",
                   "stop_budget": f"{config.stop_budget:g}s", "env": config.env},
        "built-ins": [b.family for b in built_ins.uses(config)],
        **{section.name: section.shown(config) for section in built_ins.sections()},
        "preemption": dict(zip(("enabled", "why"), built_ins.preemption(config), strict=True)),
        "lane": _lane(config),
        **({"isolation": _isolation(config)} if consumers.on(CONSUMERS.of(config)) else {}),
        "proxy": {"allow_slot_actions": config.allow_slot_actions},
        "reload": {"overlap": config.reload_overlap, "hold_timeout": f"{config.reload_hold_timeout:g}s",
                   "drain_timeout": f"{config.reload_drain_timeout:g}s"},
        "admin": {"token_file": str(config.admin_token_file) if config.admin_token_file else _default_token(),
                  "read_token_file": str(config.read_token_file) if config.read_token_file else "off"},
        "hooks": hooks,
    }


def _default_token() -> str:
    """Where the admin token comes from when the config names no file (wrapper/configuration/auth.py's order)."""
    default = default_token_file(os.environ)
    if os.environ.get("LLAMA_WRAPPER_ADMIN_TOKEN"):
        return "(not set: LLAMA_WRAPPER_ADMIN_TOKEN, which is set)"
    if default.is_file():
        return f"(not set: {default}, which exists)"
    return f"(not set, and no token: POST /wrapper/* is off until {default} or LLAMA_WRAPPER_ADMIN_TOKEN exists)"


def _body(action: Any) -> Any:
    if action.kind == "http":
        http = action.http
        body = {"method": http.method, "url": http.url}
        body.update({k: v for k, v in (("headers", http.headers), ("json", http.json), ("body", http.body),
                                        ("expect", list(http.expect))) if v})
        return body
    if action.kind == "builtin":
        return {"name": action.builtin, "with": action.options} if action.options else action.builtin
    return {"shell": action.shell, "exec": list(action.exec)}[action.kind]
