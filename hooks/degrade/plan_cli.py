"""`llama-wrapper plan`: the memory plan and the degradation ladder for a command line; no server is started."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

import click

from hooks.degrade.fit import Ask, NoRungFits, auto_budget, planner_for
from hooks.degrade.ladder import RungPlan
from hooks.degrade.settings import DEGRADE
from hooks.degrade.state import DegradeState, fitted, state_of
from wrapper.commands import Commands
from wrapper.config import Config, ConfigError
from wrapper.exits import EXIT_CONFIG, EXIT_FAILED
from wrapper.launch import Launch
from wrapper.units import format_size, parse_size


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
def plan(commands: Commands, budget: str | None, config_path: str | None, as_json: bool,
         server_argv: tuple[str, ...]) -> None:
    """Plan the memory of a llama-server command line and print the degradation ladder: each rung, the largest
    context it fits under the budget, and the bytes it needs. Exit 1 when no rung fits the budget (a start would
    fail), 2 on a bad command line or config."""
    try:
        config = commands.load(config_path)
        config = replace(config, argv=tuple(server_argv) or config.argv,
                         settings={**config.settings, DEGRADE.name: DEGRADE.of(config)})
        asks = Ask(budget=(size, "--budget")).as_mapping() if (size := _size(budget)) is not None else {}
        if budget == "auto":
            asks = Ask(budget=auto_budget(DEGRADE.of(config).reserve, config.argv)).as_mapping()
        shared: dict[str, Any] = {}
        launch: Launch | None = None
        problem: NoRungFits | None = None
        try:
            launch = commands.launch_for(config, shared, asks)
        except NoRungFits as exc:
            problem = exc
    except (ConfigError, ValueError) as exc:
        click.echo(f"llama-wrapper: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    fit = fitted(launch) if launch else None
    if fit is None and problem is None:
        notes = "; ".join(n["why"] for n in (launch.notes if launch else []) if n["change"] == "degrade: off")
        click.echo(f"llama-wrapper: nothing to plan: {notes or 'no model file'}", err=True)
        sys.exit(EXIT_CONFIG)
    if fit is not None:
        rungs, spent, source, chosen = fit.rungs, fit.budget, fit.budget_source, fit.rung
    else:
        assert problem is not None
        rungs, spent, source, chosen = problem.rungs, problem.budget, problem.budget_source, None
    report = _report(config, state_of(shared), rungs, spent, source, chosen, launch, str(problem or "") or None)
    click.echo(json.dumps(report, indent=2) if as_json else _table(report))
    if problem:
        sys.exit(EXIT_FAILED)  # a start with this budget would fail


def _report(config: Config, state: DegradeState, planned: list[RungPlan], budget: int, source: str,
            chosen: str | None, launch: Launch | None, problem: str | None) -> dict[str, Any]:
    shape = state.shape
    assert shape is not None
    first = planned[0]
    # the model's shape was read by the fit already (state.shape): the path is not read again
    planner = planner_for(first.argv, "", launch.model.id if launch else "", config, state, budget)
    as_given = planner.plan(first.argv, planner.settings(config.argv).n_ctx)
    base = next((r.max_ctx for r in planned if r.skipped is None), 0)
    rungs = []
    for rung in planned:
        row = rung.as_dict()
        if rung.skipped is None and base:
            row["gain"] = round(rung.max_ctx / base - 1, 3)
        rungs.append(row)
    return {
        "model": {"architecture": shape.architecture, "layers": shape.n_layer, "n_ctx_train": shape.n_ctx_train,
                  "sliding_window": shape.swa_window},
        "budget": {"bytes": budget, "source": source, "device": as_given.budget_device},
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
