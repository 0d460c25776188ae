"""Moving along the ladder while serving: grow for a request that overflows, relax when idle, follow a budget
change. Each move is a reload that asks the next fit for a rung (and a budget); the state in force changes
only when that reload succeeds."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Any

import structlog

from hooks.degrade import FAMILY, TURN_ON
from hooks.degrade.ladder import RungPlan, choose
from hooks.degrade.memory import PlanError
from hooks.degrade.move import move
from hooks.degrade.planning import MIN_START_CTX, auto_budget, ladder_for
from hooks.degrade.plans import Holds, TooLarge, plan_growth, plan_relax, wanted_context
from hooks.degrade.pool import member
from hooks.degrade.pool import moves as pool_moves
from hooks.degrade.settings import DEGRADE, DegradeSettings
from hooks.degrade.state import DegradeState, Fitted, context_for, fitted, state_of
from hooks.degrade.wanted import Wanted
from hooks.slots import view_of
from wrapper.configuration.config import ConfigError
from wrapper.configuration.units import format_size, parse_size
from wrapper.server.generation import Generation, Host
from wrapper.steps import CannotGrow, Grown, GrowResult, NotPlanned, error_body

log = structlog.get_logger()

RELAX_POLL_S = 5.0
POOL_POLL_S = 1.0  # a pool member below its best looks this often for memory the others freed
GATHER_S = 0.05  # a burst of overflows gathers this long, so that one reload serves them all
BUDGET_FIELDS = ("budget",)


async def grow(host: Host, needed: int, pool_full: bool = False) -> GrowResult:
    """Make the context hold `needed` more tokens for one request by reloading to the first rung that does.
    Overflows that come together share one reload sized for all of them (as many as run at once).
    `pool_full`: llama-server ran out of cells in its unified KV while the slots filled it together: the next
    larger context at least."""
    state = state_of(host.current.shared)
    if state.lock is None:
        state.lock = asyncio.Lock()
    state.waiting.append(needed)
    try:
        async with state.lock:
            fit = fitted(host.current.launch)
            if fit is None:
                return NotPlanned()
            await asyncio.sleep(GATHER_S)  # the other requests of a burst get to say what they need
            fit = fitted(host.current.launch) or fit  # another growth may have reloaded meanwhile
            wanted = wanted_context(host.current.launch.argv, held_tokens(host.current), state.waiting, pool_full,
                                    fit.n_ctx)
            if fit.n_ctx >= wanted:
                return Grown()  # another request's growth got there first
            if fit.pool is not None:
                problem = await pool_moves.grow(host, state, fit, wanted, f"this request needs {needed} tokens of "
                                               f"context ({wanted} for every slot's conversation)")
                return Grown() if problem is None else CannotGrow(problem)
            plan = plan_growth(fit.n_ctx, wanted, fit.rungs)
            if isinstance(plan, TooLarge):
                return CannotGrow(
                    f"this request needs {needed} tokens of context ({wanted} for every slot's conversation); "
                    f"the largest context under the memory budget {format_size(fit.budget)} is "
                    f"{plan.largest} tokens (rung {plan.rung or '-'}); raise degrade.budget or shorten the "
                    "conversation")
            if isinstance(plan, Holds):
                return Grown()
            why = (f"grow to {plan.rung}, n_ctx {plan.n_ctx}, for {len(state.waiting)} request(s) of up to "
                   f"{max(state.waiting)} tokens ({wanted} in all)")
            problem = await move(host, state, Wanted(rung=plan.rung), why)
            return Grown() if problem is None else CannotGrow(problem)
    finally:
        state.waiting.remove(needed)


async def background(host: Host) -> None:
    """From ready to the stop: the relax, and with a pool the answers to the others' asks."""
    state = state_of(host.current.shared)
    if member.pool_of_generation(host.current) is None:
        await relax(host)
        return
    async with asyncio.TaskGroup() as group:
        group.create_task(relax(host))
        group.create_task(member.serve_asks(host, pool_moves.give, lambda: bool(state.lock and state.lock.locked())))


async def relax(host: Host) -> None:
    """In the background: after `relax_after` with nothing in flight, move up to the best rung that holds every
    conversation seen (and whatever was restored). In a pool, a member below its best climbs back as soon as
    memory is free, and one idle for `relax_after` gives back the context only idle conversations hold."""
    state = state_of(host.current.shared)
    settings = DEGRADE.of(host.current.config)
    pooled = member.pool_of(settings) is not None
    poll = POOL_POLL_S if pooled else min(RELAX_POLL_S, settings.relax_after / 2 or RELAX_POLL_S)
    while True:
        await asyncio.sleep(poll)
        idle = time.monotonic() - state.last_activity >= settings.relax_after
        fit = fitted(host.current.launch)
        below = pooled and fit is not None and (state.gave or fit.index > 0) and time.monotonic() >= state.climb_after
        busy = host.in_flight or state.giving or (state.lock is not None and state.lock.locked())
        if busy or not (idle or below):
            continue
        try:
            if pooled:
                held = [] if idle else [t + settings.headroom for t in held_tokens(host.current)]
                needed = context_for(host.current.launch.argv, held_tokens(host.current), held)
                why = "idle for degrade.relax_after" if idle else "memory is free"
                await pool_moves.relax(host, state, needed, why)
                if idle:
                    state.last_activity = time.monotonic()
            else:
                await relax_now(host, state, settings, "idle for degrade.relax_after")
        except Exception:  # a bug here must not end the relaxing for the wrapper's whole life
            log.exception("degrade.relax_failed")
            state.last_activity = time.monotonic()


async def relax_now(host: Host, state: DegradeState, settings: DegradeSettings, why: str) -> str | None:
    fit = fitted(host.current.launch)
    if fit is None:
        return None
    needed = context_for(host.current.launch.argv, held_tokens(host.current),
                         [t + settings.headroom for t in held_tokens(host.current)])
    target = plan_relax(fit.index, fit.n_ctx, fit.rungs, needed)
    if target is None:
        state.last_activity = time.monotonic()  # nothing better: look again after another idle period
        return None
    return await move(host, state, Wanted(rung=target.name, up=True),
                      f"relax to {target.name}, n_ctx {target.max_ctx} ({why})", cut=False)


async def set_budget(host: Host, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /wrapper/budget {"budget": "2GiB" | bytes | "auto"}: plan again; degrade at once if the running
    rung no longer fits, move up if a better one now does. A budget that holds no rung changes nothing."""
    generation = host.current
    settings = DEGRADE.on(generation.config)
    fit = fitted(generation.launch)
    if settings is None:
        return 409, error_body(409, f"degradation is off: {TURN_ON}", "conflict")
    unknown = sorted(set(body) - set(BUDGET_FIELDS))
    if unknown or "budget" not in body:
        named = f"unknown field(s) {', '.join(unknown)}; " if unknown else ""
        return 400, error_body(400, f"{named}give {{\"budget\": SIZE}}: a size (\"3GiB\", \"800MiB\"), bytes, or "
                                    "\"auto\"", "invalid_request_error")
    if fit is None:
        return 409, error_body(409, "degradation has no plan for this model (see argv_changes in "
                                    "/wrapper/status)", "conflict")
    if fit.pool is not None:
        return 409, error_body(409, f"this member shares the pool {fit.pool}: its budget is the pool's total, and "
                                    "its share moves with what the members need; to change the total, stop the "
                                    "members, remove the folder and start them with the new degrade.budget",
                               "conflict")
    value = body["budget"]
    try:
        budget = (auto_budget(settings.reserve, generation.launch.argv) if value == "auto"
                  else (parse_size(value), "POST /wrapper/budget"))
    except (ValueError, ConfigError) as exc:
        return 400, error_body(400, f"budget: {exc}", "invalid_request_error")
    state = state_of(generation.shared)
    try:
        planner, rungs = ladder_for(fit.rungs[0].argv, generation.launch, generation.config, state, budget[0])
    except PlanError as exc:
        return 500, error_body(500, f"cannot plan this model: {exc}", "server_error")
    needed = context_for(generation.launch.argv, held_tokens(generation),
                         [t + settings.headroom for t in held_tokens(generation)])
    target = choose(rungs, max(needed, min(planner.ceiling, MIN_START_CTX))) or choose(rungs, needed)
    log.info("degrade.budget", budget=budget[0], previous=fit.budget, source=budget[1],
             fits=target.name if target else None)
    if target is None:
        return 400, error_body(400, f"no rung fits {format_size(budget[0])} with the conversations held now "
                                    f"({needed} tokens): the budget is unchanged", "invalid_request_error")
    ask = Wanted(rung=target.name, budget=budget)
    problem = await move(host, state, ask, f"budget {format_size(budget[0])}: {target.name}, n_ctx {target.max_ctx}")
    now = fitted(host.current.launch)
    reloaded = now is not fit
    if problem is None and not reloaded:  # the same rung and context: the plan of the running one is renewed
        host.current.launch.fitted[FAMILY] = _renewed(fit, rungs, budget, target)
        now = fitted(host.current.launch)
    answer = {"success": problem is None, "budget": budget[0], "source": budget[1],
              "rung": now.rung if now else None, "n_ctx": now.n_ctx if now else None, "reloaded": reloaded,
              "message": problem or "ok"}
    return (200 if problem is None else 500), answer


def _renewed(fit: Fitted, rungs: list[RungPlan], budget: tuple[int, str], target: RungPlan) -> Fitted:
    return replace(fit, rungs=rungs, budget=budget[0], budget_source=budget[1], index=rungs.index(target))


def held_tokens(generation: Generation) -> list[int]:
    """The tokens each slot holds, as the slot book has them (what the last answer left there, or what a start or a
    reload restored)."""
    return list(view_of(generation).held().values())


def slept(generation: Generation, asleep: bool) -> None:
    """A sleep stopped the server (a pool member gives its share), or a wake is about to fit it again."""
    pool_moves.slept(generation, asleep)
