"""`llama-wrapper plan`: the memory plan and the degradation ladder for a command line; no server is started."""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from hooks.degrade.fit import NoRungFits
from hooks.degrade.ladder import Planner, RungPlan
from hooks.degrade.memory import DEVICE, GPU_CONTEXT
from hooks.degrade.planning import BACKENDS, GPU_BACKENDS, MIN_START_CTX, auto_budget, planner_for, pool_device
from hooks.degrade.pool.folder import Pool, agree
from hooks.degrade.settings import DEGRADE, DegradeSettings
from hooks.degrade.state import DegradeState, fitted, state_of
from hooks.degrade.wanted import Wanted
from wrapper.configuration import argv as args
from wrapper.configuration.config import Config, ConfigError
from wrapper.configuration.exits import EXIT_CONFIG, EXIT_FAILED
from wrapper.configuration.units import format_size, parse_size
from wrapper.configuration.usage import SERVER_COMMAND_SETTINGS, ServerCommand
from wrapper.kept import Kept
from wrapper.launching.commands import Commands
from wrapper.launching.flags import devices, planning, unknown_flags
from wrapper.launching.launch import Launch

FOR_A_GPU = f"plan for a GPU with --backend {'|'.join(GPU_BACKENDS)} --budget SIZE"


def _size(value: str | None) -> int | None:
    if value is None or value == "auto":
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


@click.command(cls=ServerCommand, context_settings=SERVER_COMMAND_SETTINGS, epilog="""
\b
Examples:
  llama-wrapper plan --budget 3GiB -- llama-server -m model.gguf
  llama-wrapper plan --json --config chat.yaml -- llama-server -m model.gguf -c 65536
  llama-wrapper plan --backend cuda --budget 24GiB -- llama-server -m model.gguf -ngl 99 -c 32768
""")
@click.option("--budget", metavar="SIZE", help="Memory budget (3GiB, 800MiB, bytes, or auto): the GPU's when -ngl "
                                               "offloads layers to one, else the host's [default: degrade.budget "
                                               "of --config, else auto].")
@click.option("--backend", type=click.Choice(BACKENDS), metavar="NAME", help="Plan for this backend instead of "
              "this llama-server build's devices (--list-devices), e.g. for another machine: cuda, vulkan or metal "
              "put the layers -ngl offloads on that GPU, cpu offloads nothing. Needs a --budget SIZE (or "
              "degrade.budget): the GPU's memory; measured figures are not used.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), envvar="LLAMA_WRAPPER_CONFIG",
              show_envvar=True, help="Take the ladder, the budget and the hooks (slots add flags) from this config.")
@click.option("--pool", "pool_dir", type=click.Path(file_okay=False), metavar="DIR", help="Plan a new member of "
              "this pool (degrade.pool): under what the pool has free now, and what the member would take at a start "
              "(its rung at degrade.context); prints the pool's members and its last moves.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.argument("server_argv", nargs=-1, type=click.UNPROCESSED, metavar="-- LLAMA-SERVER [ARGS]...")
@click.pass_obj
def plan(commands: Commands, budget: str | None, backend: str | None, config_path: str | None,
         pool_dir: str | None, as_json: bool, server_argv: tuple[str, ...]) -> None:
    """Plan the memory of a llama-server command line and print the degradation ladder: each rung, the largest
    context it fits under the budget, and the bytes it needs. Nothing is started or written, and LLAMA-SERVER
    need not exist (it is then planned as if it had every flag). Exit 1 when no rung fits the budget (a start
    would fail), 2 on a bad command line or config."""
    with planning():  # nothing is written: no slot folder, no cached --help
        _plan(commands, budget, backend, config_path, pool_dir, as_json, server_argv)


def _plan(commands: Commands, budget: str | None, backend: str | None, config_path: str | None,
          pool_dir: str | None, as_json: bool, server_argv: tuple[str, ...]) -> None:
    try:
        config = commands.load(config_path)
        settings = DEGRADE.of(config)
        config = replace(config, argv=tuple(server_argv) or config.argv,
                         settings={**config.settings, DEGRADE.name: replace(settings, pool=None)})
        if unknown := unknown_flags(list(config.argv)):
            raise ConfigError(f"{config.argv[0]} does not know {', '.join(unknown)} (its --help does not list "
                              f"{'it' if len(unknown) == 1 else 'them'}): llama-server would refuse to start")
        pooled = _pool(Path(pool_dir).expanduser() if pool_dir else settings.pool, config, settings, backend)
        size = _size(budget)
        if backend is not None and size is None and (budget == "auto" or DEGRADE.of(config).budget is None):
            raise ConfigError(f"--backend {backend} plans for another machine: give its memory with --budget SIZE "
                              "(auto would measure this one's)")
        given = (size, "--budget") if size is not None else None
        if pooled is not None and pooled["total"] is not None and budget is None:
            given = (max(0, int(pooled["free"])), f"free in the pool {pooled['dir']}")
        if budget == "auto":
            given = auto_budget(DEGRADE.of(config).reserve, config.argv)
        asks = Wanted(budget=given, backend=backend).as_asks()
        shared = Kept()
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
    report = _report(config, state_of(shared), rungs, spent, source, chosen, launch, str(problem or "") or None,
                     backend)
    if pooled is not None:
        report["pool"] = {**pooled, "new_member": _new_member(config, state_of(shared), rungs, chosen, launch,
                                                              backend)}
    click.echo(json.dumps(report, indent=2) if as_json else _table(report))
    if problem:
        sys.exit(EXIT_FAILED)  # a start with this budget would fail


def _report(config: Config, state: DegradeState, planned: list[RungPlan], budget: int, source: str,
            chosen: str | None, launch: Launch | None, problem: str | None, backend: str | None) -> dict[str, Any]:
    shape = state.shape
    assert shape is not None
    first = planned[0]
    # the model's shape was read by the fit already (state.shape): the path is not read again
    planner = planner_for(first.argv, "", launch.model.id if launch else "", config, state, budget, backend)
    as_given = planner.plan(first.argv, planner.choices(config.argv).n_ctx)
    base = next((r.max_ctx for r in planned if r.skipped is None), 0)
    rungs = []
    for rung in planned:
        row = rung.as_dict()
        if rung.skipped is None and base:
            row["gain"] = round(rung.max_ctx / base - 1, 3)
        if rung.plan is not None:  # what the budget holds: the bytes on its device
            device = rung.plan.budget_device
            row["on_budget_device"] = {"device": device, **rung.plan.as_dict()["devices"].get(device, {})}
        rungs.append(row)
    return {
        "model": {"architecture": shape.architecture, "layers": shape.n_layer, "n_ctx_train": shape.n_ctx_train,
                  "sliding_window": shape.swa_window},
        "budget": {"bytes": budget, "source": source, "device": as_given.budget_device},
        **_device(first.argv, planner, backend),
        "current": as_given.as_dict(), "rungs": rungs, "start": chosen, "problem": problem,
    }


def _pool(directory: Path | None, config: Config, settings: DegradeSettings,
          backend: str | None) -> dict[str, Any] | None:
    """The pool as it is now, checked as a start checks it (nothing is written: a folder that is no pool yet is
    reported as such, and whether a member could make it there)."""
    if directory is None:
        return None
    if not (directory / "pool.json").exists():
        existing = next(p for p in (directory, *directory.parents) if p.exists())
        writable = existing.is_dir() and os.access(existing, os.W_OK)
        note = ("no pool there yet: the first member to start makes it with its degrade.budget" if writable else
                f"no pool there, and {existing} cannot be written: a member could not make it; give degrade.pool a "
                "folder every member can write, e.g. /run/llama-wrapper/gpu0")
        return {"dir": str(directory), "total": None, "used": 0, "free": None, "members": [], "moves": [],
                "note": note}
    with Pool(directory).locked() as held:
        found = held.made()
        assert found is not None
        agree(directory, found, settings.budget or int(found["total"]), pool_device(config.argv, backend),
              settings.budget is not None)
        return held.summary()


def _new_member(config: Config, state: DegradeState, planned: list[RungPlan], chosen: str | None,
                launch: Launch | None, backend: str | None) -> dict[str, Any] | None:
    """What a member started now would take: its rung at degrade.context (a member takes what it needs)."""
    rung = next((r for r in planned if r.name == chosen), None)
    if rung is None or launch is None:
        return None
    planner = planner_for(rung.argv, "", launch.model.id, config, state, 0, backend)
    n_ctx = min(planner.ceiling, DEGRADE.of(config).context or MIN_START_CTX, max(rung.max_ctx, 256))
    taken = planner.plan(rung.argv, n_ctx)
    return {"rung": rung.name, "n_ctx": n_ctx, "share": taken.total(taken.budget_device)}


def _device(argv: list[str], planner: Planner, backend: str | None) -> dict[str, Any]:
    """What -ngl offloads to, and where that was learnt: `device` for --json, and `notes` (one line each)."""
    binary = argv[0]
    found = shutil.which(binary) is not None
    listed = devices(binary) if found else None
    shape, layers = planner.shape, planner.choices(argv).gpu_layers
    ngl = args.get(argv, args.GPU_LAYERS)
    asked = f"-ngl {ngl}" if ngl is not None else "-ngl auto (the default)"
    if not layers:
        no_device = (args.get(argv, DEVICE) or "").lower() == "none"
        offload = f"{asked} offloads nothing" + (" (-dev none)" if no_device else "")
    elif layers > shape.n_layer:
        offload = f"{asked} offloads all {shape.n_layer} layers and the output layer"
    else:
        offload = f"{asked} offloads {layers} of {shape.n_layer} layers"
    notes = [] if found else [f"{binary} not found: planned as if it has every flag; give its path to check them"]
    if backend in GPU_BACKENDS:
        source, line = "--backend", f"{backend} GPU (--backend): {offload}"
        if backend != "cuda":
            line += f"; its context is taken as CUDA's {format_size(GPU_CONTEXT)} (measured on an H200)"
    elif backend == "cpu":
        source, line = "--backend", "CPU (--backend)" + (f": {asked} offloads nothing" if ngl else "")
    elif listed:
        source, line = "--list-devices", f"{listed[0]} (--list-devices): {offload}"
    else:
        nothing = f", so {asked} offloads nothing" if args.offloaded(argv) else ""
        if not found:
            source, why = "unknown", f"{binary}'s devices are unknown{nothing}"
        elif listed is None:
            source, why = "unknown", f"this llama-server does not list its devices (--list-devices){nothing}"
        else:
            source, why = "--list-devices", f"this llama-server build has no GPU backend{nothing}"
        line = f"CPU ({why}; {FOR_A_GPU})"
    notes.append(f"device: {line}")
    name = backend or (listed[0].split(":")[0] if listed else "cpu")
    device = {"backend": name, "source": source, "listed": listed, "gpu_layers": min(layers, shape.n_layer + 1)}
    return {"device": device, "notes": notes}


def _table(report: dict[str, Any]) -> str:
    model, budget = report["model"], report["budget"]
    current, device = report["current"], budget["device"]
    lines = [f"model: {model['architecture']}, {model['layers']} layers, trained context {model['n_ctx_train']}"
             + (f", sliding window {model['sliding_window']}" if model["sliding_window"] else ""),
             f"budget: {format_size(budget['bytes'] or 0)} on the {device} ({budget['source']})",
             *report["notes"],
             _as_given(current, device),
             "",
             f"{'rung':<16}{'max ctx':>10}{'gain':>8}{'weights':>12}{'context':>12}{'total':>12}  figures"
             + (f" (bytes on the {device})" if len(current["devices"]) > 1 else "")]
    for row in report["rungs"]:
        if "skipped" in row:
            lines.append(f"{row['name']:<16}{'-':>10}{'':>8}{'':>12}{'':>12}{'':>12}  skipped: {row['skipped']}")
            continue
        nbytes = row.get("on_budget_device") or {**row["bytes"], "device": device}
        context = nbytes.get("kv", 0) + nbytes.get("compute", 0) + nbytes.get("other", 0)
        measured = row["measured"]
        figures = "measured " + ", ".join(measured) if measured else "predicted"
        if nbytes["device"] != device:
            figures += f" (bytes on the {nbytes['device']})"
        gain = f"{row['gain'] * 100:+.0f}%" if row.get("gain") else "-"
        lines.append(f"{row['name']:<16}{row['max_ctx']:>10,}{gain:>8}{_short(nbytes.get('weights', 0)):>12}"
                     f"{_short(context):>12}{_short(nbytes.get('total', 0)):>12}  {figures}")
    if report["start"]:
        lines += ["", f"a start under this budget runs rung {report['start']}"]
    if (pool := report.get("pool")) is not None:
        lines += ["", *_pool_lines(pool)]
    if report["problem"]:
        lines += ["", report["problem"]]
    return "\n".join(lines)


def _sleeper(member: dict[str, Any]) -> str:
    """A member asleep (its share free until it wakes), or one that sleeps when asked (the pool's last rung)."""
    if member.get("asleep"):
        return ", asleep (wakes at its next request)"
    if member.get("sleeps_when_asked"):
        return f", sleeps when asked after {member['sleeps_when_asked']:g}s idle"
    return ""


def _pool_lines(pool: dict[str, Any]) -> list[str]:
    new = pool.get("new_member")
    takes = [f"a new member takes {format_size(new['share'])}: rung {new['rung']} at n_ctx {new['n_ctx']}"] \
        if new is not None else []
    if pool["total"] is None:
        return [f"pool {pool['dir']}: {pool['note']}", *takes]
    lines = [f"pool {pool['dir']}: {format_size(pool['total'])} on the {pool['device']}, "
             f"{format_size(pool['used'])} used by {len(pool['members'])} member(s), {format_size(pool['free'])} free"]
    lines += [f"  {m['name']}: {format_size(m['share'])} (floor {format_size(m['floor'])}), rung {m['rung']}, "
              f"n_ctx {m['n_ctx']}{', busy' if m['busy'] else ''}{_sleeper(m)}" for m in pool["members"]]
    lines += takes
    if pool["free"] is not None and new is not None and new["share"] > pool["free"]:
        lines.append("  more than is free: a member starting now asks the others for the rest")
    lines += [f"  moved: {m['asker']} asked {format_size(m['asked'])}, got {format_size(m['given'])} in "
              f"{m['took_s']}s" for m in pool["moves"][-5:]]
    return lines


def _as_given(current: dict[str, Any], device: str) -> str:
    """What the command line as given needs: on the budget's device, and what the others hold besides."""
    on = current["devices"].get(device) or dict.fromkeys(("weights", "kv", "compute", "other", "total"), 0)
    parts = ", ".join(f"{label} {format_size(on[name])}" for label, name in
                      (("weights", "weights"), ("KV", "kv"), ("compute", "compute"), ("other", "other")))
    others = [f"{format_size(bytes_['total'])} on the {name}" for name, bytes_ in current["devices"].items()
              if name != device]
    if not others:
        return f"as given: -c {current['n_ctx']} needs {format_size(on['total'])} ({parts})"
    return f"as given: -c {current['n_ctx']} needs {format_size(on['total'])} on the {device} ({parts}), " \
           f"and {', '.join(others)}"


def _short(nbytes: int) -> str:
    return format_size(nbytes).replace(" GiB", "G").replace(" MiB", "M")
