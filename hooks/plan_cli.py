"""`llama-wrapper plan`: the memory plan and the degradation ladder for a command line; no server is started."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import click

from hooks import degrade
from wrapper.config import EXIT_CONFIG, Config, ConfigError, Degrade, load_config
from wrapper.launch import Launch
from wrapper.units import format_size, parse_size

Prepare = Callable[[Config, dict[str, Any]], Launch]  # wrapper/extensions.prepare, passed by the CLI group


def _size(value: str | None) -> int | None:
    if value is None or value == "auto":
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}, epilog="""
\b
Examples:
  llama-wrapper plan --budget 3GiB -- llama-server -m model.gguf
  llama-wrapper plan --json --config chat.yaml -- llama-server -m model.gguf -c 65536
""")
@click.option("--budget", metavar="SIZE", help="Memory budget (3GiB, 800MiB, bytes, or auto) [default: "
                                               "degrade.budget of --config, else auto].")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="LLAMA_WRAPPER_CONFIG",
              show_envvar=True, help="Take the ladder, the budget and the hooks (slots add flags) from this config.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.argument("server_argv", nargs=-1, type=click.UNPROCESSED, metavar="-- LLAMA-SERVER [ARGS]...")
@click.pass_obj
def plan(prepare: Prepare, budget: str | None, config_path: str | None, as_json: bool,
         server_argv: tuple[str, ...]) -> None:
    """Plan the memory of a llama-server command line and print the degradation ladder: each rung, the largest
    context it fits under the budget, and the bytes it needs. Exit 1 when no rung fits the budget (a start would
    fail), 2 on a bad command line or config."""
    try:
        config = load_config(config_path) if config_path else Config()
        setting = replace(config.degrade or Degrade(), budget=_size(budget) if budget else (
            config.degrade.budget if config.degrade else None))
        config = replace(config, argv=tuple(server_argv) or config.argv, degrade=setting)
        shared: dict[str, Any] = {}
        launch: Launch | None = None
        problem: str | None = None
        try:
            launch = prepare(config, shared)
        except ConfigError as exc:
            if not degrade.state_of(shared).rungs:
                raise
            problem = str(exc)
    except (ConfigError, ValueError) as exc:
        click.echo(f"llama-wrapper: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    state = degrade.state_of(shared)
    if not state.rungs:
        notes = "; ".join(n["why"] for n in (launch.notes if launch else []) if n["change"] == "degrade: off")
        click.echo(f"llama-wrapper: nothing to plan: {notes or 'no model file'}", err=True)
        sys.exit(EXIT_CONFIG)
    report = _report(config, state, launch, problem)
    click.echo(json.dumps(report, indent=2) if as_json else _table(report))
    if problem:
        sys.exit(1)  # a start with this budget would fail


def _report(config: Config, state: degrade.DegradeState, launch: Launch | None, problem: str | None) -> dict[str, Any]:
    shape = state.shape
    assert shape is not None
    first = state.rungs[0]
    # the model's shape was read by the fit already (state.shape): the path is not read again
    planner = degrade.planner_for(first.argv, "", launch.model.id if launch else "", config, state,
                                  state.budget or 0)
    as_given = planner.plan(first.argv, planner.settings(config.argv).n_ctx)
    chosen = (launch.prepared.get("degrade") or {}).get("rung") if launch else None
    base = next((r.max_ctx for r in state.rungs if r.skipped is None), 0)
    rungs = []
    for rung in state.rungs:
        row = rung.as_dict()
        if rung.skipped is None and base:
            row["gain"] = round(rung.max_ctx / base - 1, 3)
        rungs.append(row)
    return {
        "model": {"architecture": shape.architecture, "layers": shape.n_layer, "n_ctx_train": shape.n_ctx_train,
                  "sliding_window": shape.swa_window},
        "budget": {"bytes": state.budget, "source": state.budget_source, "device": as_given.budget_device},
        "current": as_given.as_dict(), "rungs": rungs, "start": chosen, "problem": problem,
    }


def _table(report: dict[str, Any]) -> str:
    model, budget = report["model"], report["budget"]
    current = report["current"]
    lines = [f"model: {model['architecture']}, {model['layers']} layers, trained context {model['n_ctx_train']}"
             + (f", sliding window {model['sliding_window']}" if model["sliding_window"] else ""),
             f"budget: {format_size(budget['bytes'] or 0)} on the {budget['device']} ({budget['source']})",
             f"as given: -c {current['n_ctx']} needs {format_size(current['bytes']['total'])} "
             f"(weights {format_size(current['bytes']['weights'])}, KV {format_size(current['bytes']['kv'])}, "
             f"compute {format_size(current['bytes']['compute'])}, other {format_size(current['bytes']['other'])})",
             "",
             f"{'rung':<16}{'max ctx':>10}{'gain':>8}{'weights':>12}{'context':>12}{'total':>12}  figures"]
    for row in report["rungs"]:
        if "skipped" in row:
            lines.append(f"{row['name']:<16}{'-':>10}{'':>8}{'':>12}{'':>12}{'':>12}  skipped: {row['skipped']}")
            continue
        nbytes = row["bytes"]
        context = nbytes["kv"] + nbytes["compute"] + nbytes["other"]
        measured = row["measured"]
        figures = "measured " + ", ".join(measured) if measured else "predicted"
        gain = f"{row['gain'] * 100:+.0f}%" if row.get("gain") else "-"
        lines.append(f"{row['name']:<16}{row['max_ctx']:>10,}{gain:>8}{_short(nbytes['weights']):>12}"
                     f"{_short(context):>12}{_short(nbytes['total']):>12}  {figures}")
    if report["start"]:
        lines += ["", f"a start under this budget runs rung {report['start']}"]
    if report["problem"]:
        lines += ["", report["problem"]]
    return "\n".join(lines)


def _short(nbytes: int) -> str:
    return format_size(nbytes).replace(" GiB", "G").replace(" MiB", "M")
