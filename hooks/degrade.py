"""Built-in degradation under a memory budget (`degrade:` in the config).

At every start and reload the child's argv is fitted to the budget: the ladder's rungs are planned
(hooks/ladder.py, hooks/memory.py, calibrated by hooks/calibration.py) and the chosen rung runs with the
largest context that fits. The chosen rung is the best one, unless a growth, a relax or a budget change asked
for another. A request that overflows the context makes the wrapper grow (the listener calls `grow`): reload
to the first rung whose context holds it, then send the same request again. Idle long enough, the wrapper
relaxes back up to the best rung that holds every conversation.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from hooks import calibration, slotdir, slots
from hooks.ladder import Planner, RungPlan, build, choose
from hooks.memory import ModelShape, Plan, PlanError, Settings, plan, read_shape
from wrapper import argv as args
from wrapper.config import Config, ConfigError, Degrade
from wrapper.generation import Generation, Host
from wrapper.launch import Fitting, Launch
from wrapper.reload_plan import BUSY_RELOADING, ReloadRefused
from wrapper.server_help import devices, flag_arity
from wrapper.sysinfo import gpu_free, mem_available
from wrapper.units import format_size, parse_size

log = structlog.get_logger()

FAMILY = "degrade"
TURN_ON = "add a degrade: section to the config (at least degrade: {budget: auto})"
MIN_START_CTX = 1024  # the first rung whose context reaches this (or the ceiling) is where a start begins
VERBOSITY = ("-lv", "--verbosity", "--log-verbosity")
RELAX_POLL_S = 5.0
BUSY_RETRY_S = 0.2
GATHER_S = 0.05


@dataclass
class DegradeState:
    """Lives as long as the wrapper: the budget, the rung asked for, the last plans and what happened."""

    budget: int | None = None
    budget_source: str = ""
    target: str | None = None  # a rung name asked for by a growth, a relax or a budget change
    rungs: list[RungPlan] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    last_activity: float = field(default_factory=time.monotonic)
    conversation: dict[int, int] = field(default_factory=dict)  # slot -> tokens, from proxied answers
    lock: asyncio.Lock | None = None
    waiting: list[int] = field(default_factory=list)  # the tokens each request waiting for a growth needs
    shape: ModelShape | None = None


@dataclass
class Measuring:
    """What degrade knows of one child: the rung it runs and the buffers it reported."""

    measured: calibration.Measured = field(default_factory=calibration.Measured)
    remembered: bool = False


def in_use(config: Config) -> bool:
    return config.degrade is not None


def state_of(shared: dict[str, Any]) -> DegradeState:
    state = shared.setdefault(FAMILY, DegradeState())
    assert isinstance(state, DegradeState)
    return state


def _generation(rt: Generation) -> Measuring:
    generation = rt.state.setdefault(FAMILY, Measuring())
    assert isinstance(generation, Measuring)
    return generation


# -- planning ----------------------------------------------------------------------------------------------


def planner_for(argv: Sequence[str], model_path: str, model_id: str, config: Config, state: DegradeState,
                budget: int) -> Planner:
    if state.shape is None:
        state.shape = read_shape(model_path)
    shape = state.shape
    gpu = bool(devices(argv[0]))
    runs = calibration.load(model_id)
    user_ctx = _int(args.get(config.argv, args.CTX_SIZE))
    ceiling = min(shape.n_ctx_train or 1 << 20, user_ctx or 1 << 20)

    def predict(s: Settings) -> Plan:
        return plan(shape, s, _file_size(s.mmproj), _draft(s))

    def calibrate(predicted: Plan, s: Settings) -> Plan:
        return calibration.calibrated(predicted, s, runs, predict)

    return Planner(shape, gpu, budget, ceiling, lambda s: _file_size(s.mmproj), _draft, calibrate)


def resolve_budget(degrade: Degrade, argv: Sequence[str]) -> tuple[int, str]:
    """The configured budget, or `auto`: free memory of the first GPU (nvidia-smi) when layers are offloaded
    to one, else MemAvailable minus `degrade.reserve`."""
    if degrade.budget is not None:
        return degrade.budget, "degrade.budget"
    offloaded = args.get(argv, ("-ngl", "--gpu-layers", "--n-gpu-layers")) not in (None, "0")
    if offloaded and (free := gpu_free()) is not None:
        return free, "auto: free GPU memory (nvidia-smi)"
    available = mem_available()
    if available is None:
        raise ConfigError("degrade.budget is auto, and neither nvidia-smi nor /proc/meminfo says how much memory "
                          "is free: give degrade.budget a size")
    return max(0, available - degrade.reserve), f"auto: MemAvailable minus {format_size(degrade.reserve)}"


def fit(argv: list[str], launch: Launch, config: Config, shared: dict[str, Any]) -> Fitting:
    """The child's argv for the chosen rung at its largest context under the budget."""
    assert config.degrade is not None
    state = state_of(shared)
    out = Fitting(list(argv))
    if launch.model.path is None:
        out.note("degrade: off", "no -m model file to plan with (-hf and URLs are not planned)")
        return out
    if state.budget is None:
        state.budget, state.budget_source = resolve_budget(config.degrade, argv)
    try:
        planner = planner_for(argv, launch.model.path, launch.model.id, config, state, state.budget)
    except PlanError as exc:
        out.note("degrade: off", f"cannot plan this model: {exc}")
        return out
    rungs = build(argv, config.degrade.ladder, planner, flag_arity(argv[0]), config.argv,
                  planner.shape.swa_window is not None)
    state.rungs = rungs
    chosen = _chosen(rungs, state, max(min(planner.ceiling, MIN_START_CTX), _saved_tokens(launch, config.degrade)))
    if chosen is None:
        smallest = min((r.plan.total(r.plan.budget_device) for r in rungs if r.plan), default=0)
        raise ConfigError(f"degrade.budget {format_size(state.budget)} ({state.budget_source}) holds no rung of the "
                          f"ladder: the smallest needs {format_size(smallest)} at 256 tokens of context; raise the "
                          "budget or use a smaller model")
    out.argv = args.replace(chosen.argv, args.CTX_SIZE, str(chosen.max_ctx))
    flags = flag_arity(argv[0])
    if not args.has(out.argv, VERBOSITY) and (flags is None or "-lv" in flags):
        out.argv += ["-lv", "4"]
        out.note("-lv 4", "llama-server prints its buffer sizes only at verbosity 4: the planner learns from them "
                 "(the wrapper logs the extra lines at debug level)")
    planned = chosen.plan
    assert planned is not None
    out.note(f"degrade: rung {chosen.name}, -c {chosen.max_ctx}",
             f"the largest context under the budget {format_size(state.budget)} ({state.budget_source}); planned "
             f"{format_size(planned.total(planned.budget_device))} on the {planned.budget_device}")
    out.prepared = {"rung": chosen.name, "index": rungs.index(chosen), "n_ctx": chosen.max_ctx,
                    "settings": planner.settings(out.argv),
                    "swa_dropped": args.has(argv, args.SWA_FULL) and not args.has(out.argv, args.SWA_FULL),
                    "verbosity_added": "-lv 4" in " ".join(out.argv[-2:])}
    return out


def _chosen(rungs: list[RungPlan], state: DegradeState, wanted: int) -> RungPlan | None:
    """The rung a growth, relax or budget change asked for; else the best one whose context reaches `wanted`,
    else the one with the largest context."""
    if state.target is not None:
        named = next((r for r in rungs if r.name == state.target and r.skipped is None and r.max_ctx), None)
        if named is not None:
            return named
    usable = [r for r in rungs if r.skipped is None and r.max_ctx > 0]
    return choose(rungs, wanted) or (max(usable, key=lambda r: r.max_ctx) if usable else None)


def _saved_tokens(launch: Launch, degrade: Degrade) -> int:
    """The longest conversation saved for this model, plus headroom: a start should be able to restore it."""
    directory = launch.prepared.get(slots.FAMILY)
    if not isinstance(directory, Path):
        return 0
    tokens = []
    for saved in slotdir.saved_slots(directory):
        try:
            tokens.append(int(slotdir.read_sidecar(saved.sidecar).get("tokens") or 0))
        except (slotdir.SidecarError, ValueError, TypeError):
            continue  # slots.restore reports it
    return max(tokens) + degrade.headroom if tokens else 0


# -- what a generation reports -------------------------------------------------------------------------------


def server_line(rt: Generation, line: str) -> bool:
    """Feed the start-up buffer lines to the calibration; False for the lines -lv 4 added that are not news."""
    generation = _generation(rt)
    prepared = rt.launch.prepared.get(FAMILY) or {}
    if not generation.measured.done:
        generation.measured.feed(line)
        if generation.measured.done and not generation.remembered and prepared:
            generation.remembered = True
            calibration.remember(rt.launch.model.id, generation.measured, prepared["settings"])
            log.info("degrade.measured", n_ctx=generation.measured.n_ctx, buffers=generation.measured.buffers)
        return True
    return not prepared.get("verbosity_added") or " I srv " in line or " W " in line or " E " in line


def observer(rt: Generation) -> Any:
    state = state_of(rt.shared)

    def seen(path: str, status: int, tail: bytes) -> None:
        state.last_activity = time.monotonic()
        tokens = _conversation_tokens(tail)
        if tokens is not None:
            state.conversation[tokens[0]] = tokens[1]

    return seen


def status(rt: Generation) -> dict[str, Any]:
    state = state_of(rt.shared)
    prepared = rt.launch.prepared.get(FAMILY) or {}
    return {
        "budget": state.budget, "budget_source": state.budget_source, "rung": prepared.get("rung"),
        "n_ctx": prepared.get("n_ctx"), "ladder": [r.as_dict() for r in state.rungs],
        "steps": state.steps[-20:],
        "swa_window_note": ("the sliding-window cache is not full: restored slots would not be reused, so slots "
                            "are not saved on this rung") if prepared.get("swa_dropped") else None,
    }


def memory(rt: Generation) -> dict[str, Any]:
    """GET /wrapper/memory: planned and measured bytes per device and component."""
    state = state_of(rt.shared)
    prepared = rt.launch.prepared.get(FAMILY) or {}
    chosen = next((r for r in state.rungs if r.name == prepared.get("rung")), None)
    measured = _generation(rt).measured
    planned = chosen.plan.as_dict() if chosen is not None and chosen.plan is not None else None
    return {
        "budget": {"bytes": state.budget, "source": state.budget_source,
                   "device": planned["budget_device"] if planned else None},
        "rung": prepared.get("rung"), "n_ctx": prepared.get("n_ctx"),
        "planned": planned,
        "measured": {"n_ctx": measured.n_ctx, "devices": {d: {**parts, "total": sum(parts.values())}
                                                           for d, parts in measured.devices.items()},
                     "buffers": measured.buffers, "complete": measured.done},
    }


async def memory_route(host: Host, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 200, memory(host.current)


# -- growing, relaxing, budget changes --------------------------------------------------------------------


async def grow(host: Host, needed: int, pool_full: bool = False) -> str | None:
    """Make the context hold `needed` more tokens for one request by reloading to the first rung that does;
    None when done (send the request again), else why it cannot be done. Overflows that come together share
    one reload sized for all of them (as many as run at once). `pool_full`: llama-server ran out of cells in
    its unified KV while the slots filled it together: the next larger context at least."""
    state = state_of(host.current.shared)
    if state.lock is None:
        state.lock = asyncio.Lock()
    state.waiting.append(needed)
    try:
        async with state.lock:
            if not state.rungs:
                return ""  # nothing was planned (no model file): the overflow stands as llama-server said it
            await asyncio.sleep(GATHER_S)  # the other requests of a burst get to say what they need
            current = host.current.launch.prepared.get(FAMILY) or {}
            n_ctx = int(current.get("n_ctx") or 0)
            wanted = context_for(host.current.launch.argv, state, state.waiting)
            if pool_full:
                wanted = max(wanted, n_ctx + 1)
            if n_ctx >= wanted:
                return None  # another request's growth got there first
            target = choose(state.rungs, wanted)
            if target is None:
                best = max(state.rungs, key=lambda r: r.max_ctx, default=None)
                return (f"this request needs {needed} tokens of context ({wanted} for every slot's conversation); "
                        f"the largest context under the memory budget {format_size(state.budget or 0)} is "
                        f"{best.max_ctx if best else 0} tokens (rung {best.name if best else '-'}); raise "
                        "degrade.budget or shorten the conversation")
            return await _move(host, state, target, f"grow to {target.name}, n_ctx {target.max_ctx}, for "
                                                    f"{len(state.waiting)} request(s) of up to {max(state.waiting)} "
                                                    f"tokens ({wanted} in all)")
    finally:
        state.waiting.remove(needed)


def context_for(argv: Sequence[str], state: DegradeState, demands: Sequence[int]) -> int:
    """The `-c` that holds `demands` (the tokens requests need) beside what the other slots hold. With one KV
    for all slots (-kvu) their cells add up: the demands that can run at once, plus the conversations they
    do not replace; without it every slot gets -c / -np cells, so the largest demand times -np."""
    parallel = max(1, int(args.get(argv, args.PARALLEL) or 1))
    running = sorted(demands, reverse=True)[:parallel]
    if not running:
        return 0
    if parallel == 1:
        return running[0]
    if args.last_of(argv, args.KV_UNIFIED, args.NO_KV_UNIFIED):
        held = sorted(state.conversation.values(), reverse=True)[len(running):]  # slots the requests do not use
        return sum(running) + sum(held)
    return running[0] * parallel


async def _move(host: Host, state: DegradeState, target: RungPlan, why: str) -> str | None:
    before = state.target
    state.target = target.name
    began = time.monotonic()
    answer: dict[str, Any] | None = None
    deadline = began + host.current.config.reload_hold_timeout
    while answer is None:
        try:
            answer = await host.reload({}, f"degrade: {why}")
        except ReloadRefused as exc:
            if str(exc) != BUSY_RELOADING or time.monotonic() > deadline:
                state.target = before
                return None if "nothing to change" in str(exc) else str(exc)
            await asyncio.sleep(BUSY_RETRY_S)  # another reload runs: wait for it, then ours
    current = host.current.launch.prepared.get(FAMILY) or {}
    step = {"at": time.time(), "why": why, "success": bool(answer.get("success")), "rung": current.get("rung"),
            "n_ctx": answer.get("n_ctx"), "downtime_ms": answer.get("downtime_ms"),
            "wait_s": round(time.monotonic() - began, 3), "restore": answer.get("restore")}
    state.steps.append(step)
    log.info("degrade.step", **step)
    if not answer.get("success"):
        state.target = before
        return f"the reload to grow the context failed: {answer.get('message')}"
    return None


async def relax(host: Host) -> None:
    """In the background: after `relax_after` with nothing in flight, move up to the best rung that holds every
    conversation seen (and whatever was restored)."""
    state = state_of(host.current.shared)
    degrade = host.current.config.degrade
    assert degrade is not None
    while True:
        await asyncio.sleep(min(RELAX_POLL_S, degrade.relax_after / 2 or RELAX_POLL_S))
        if host.in_flight or time.monotonic() - state.last_activity < degrade.relax_after:
            continue
        try:
            await relax_now(host, state, degrade, "idle for degrade.relax_after")
        except Exception:  # a bug here must not end the relaxing for the wrapper's whole life
            log.exception("degrade.relax_failed")
            state.last_activity = time.monotonic()


async def relax_now(host: Host, state: DegradeState, degrade: Degrade, why: str) -> str | None:
    current = host.current.launch.prepared.get(FAMILY) or {}
    index = int(current.get("index", 0))
    needed = context_for(host.current.launch.argv, state, [t + degrade.headroom for t in _held(state, host.current)])
    target = choose(state.rungs, needed)
    if target is None or (state.rungs.index(target) >= index and target.max_ctx <= int(current.get("n_ctx") or 0)):
        state.last_activity = time.monotonic()  # nothing better: look again after another idle period
        return None
    return await _move(host, state, target, f"relax to {target.name}, n_ctx {target.max_ctx} ({why})")


async def set_budget(host: Host, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /wrapper/budget {"budget": "2GiB" | bytes | "auto"}: plan again; degrade at once if the running
    rung no longer fits, move up if a better one now does."""
    rt = host.current
    degrade = rt.config.degrade
    if degrade is None:
        return 409, _error(409, f"degradation is off: {TURN_ON}", "conflict")
    value = body.get("budget")
    try:
        if value == "auto":
            budget, source = resolve_budget(Degrade(budget=None, reserve=degrade.reserve), rt.launch.argv)
        else:
            budget, source = parse_size(value), "POST /wrapper/budget"
    except (ValueError, ConfigError) as exc:
        return 400, _error(400, f"budget: {exc}", "invalid_request_error")
    state = state_of(rt.shared)
    old = state.budget
    state.budget, state.budget_source = budget, source
    state.target = None
    log.info("degrade.budget", budget=budget, previous=old, source=source)
    planner = planner_for(rt.launch.argv, rt.launch.model.path or "", rt.launch.model.id, rt.config, state, budget)
    fitted = rt.launch.prepared.get(FAMILY) or {}
    base = state.rungs[0].argv if state.rungs else rt.launch.argv
    state.rungs = build(base, degrade.ladder, planner, flag_arity(base[0]), rt.config.argv,
                        planner.shape.swa_window is not None)
    needed = context_for(rt.launch.argv, state, [t + degrade.headroom for t in _held(state, rt)])
    target = choose(state.rungs, max(needed, min(planner.ceiling, MIN_START_CTX))) or choose(state.rungs, needed)
    if target is None:
        state.budget, state.budget_source = old, state.budget_source
        return 400, _error(400, f"no rung fits {format_size(budget)} with the conversations held now "
                                f"({needed} tokens): the budget is unchanged", "invalid_request_error")
    unchanged = target.name == fitted.get("rung") and target.max_ctx == fitted.get("n_ctx")
    problem = None if unchanged else await _move(host, state, target, f"budget {format_size(budget)}: "
                                                 f"{target.name}, n_ctx {target.max_ctx}")
    current = host.current.launch.prepared.get(FAMILY) or {}
    answer = {"success": problem is None, "budget": budget, "source": source, "rung": current.get("rung"),
              "n_ctx": current.get("n_ctx"), "reloaded": not unchanged, "message": problem or "ok"}
    return (200 if problem is None else 500), answer


def _error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"code": status, "message": message, "type": kind}}


# -- helpers -----------------------------------------------------------------------------------------------


def _held(state: DegradeState, rt: Generation) -> list[int]:
    """Tokens held per slot: as the last answers said, or as restored at the start before any answer."""
    return list(state.conversation.values()) or slots.restored_tokens(rt)


def _conversation_tokens(tail: bytes) -> tuple[int, int] | None:
    """(slot, tokens in it) from the end of a completion answer: cache_n + prompt_n + predicted_n."""
    found = {key: re.findall(rb'"' + key.encode() + rb'"\s*:\s*(\d+)', tail)
             for key in ("cache_n", "prompt_n", "predicted_n", "id_slot")}
    if not found["prompt_n"]:
        return None
    slot = int(found["id_slot"][-1]) if found["id_slot"] else 0
    total = sum(int(found[k][-1]) for k in ("cache_n", "prompt_n", "predicted_n") if found[k])
    return slot, total


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None and int(text) > 0 else None
    except ValueError:
        return None


def _file_size(path: str | None) -> int:
    try:
        return Path(path).stat().st_size if path else 0
    except OSError:
        return 0


def _draft(s: Settings) -> ModelShape | None:
    if not s.draft:
        return None
    try:
        return read_shape(s.draft)
    except PlanError:
        return None
