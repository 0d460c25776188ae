"""The moves of a pool member (`degrade.pool`): a growth that asks the others for what is not free, giving
when another asks, and climbing back when memory is free again. Each is a move (hooks/degrade/move.py) whose
fit takes its share of the pool (hooks/degrade/fit.py)."""

from __future__ import annotations

import os
import time

import structlog

from hooks.degrade.ladder import RungPlan
from hooks.degrade.move import move
from hooks.degrade.planning import ladder_for
from hooks.degrade.plans import GrowTo, TooLarge, plan_growth
from hooks.degrade.pool import member
from hooks.degrade.pool.folder import Pool, Request
from hooks.degrade.pool.plans import (
    Refuse,
    Running,
    Stay,
    give_limit,
    plan_climb,
    plan_give,
    resting_context,
    smallest_context,
)
from hooks.degrade.settings import DEGRADE
from hooks.degrade.state import DegradeState, Fitted, context_for, fitted, state_of
from hooks.degrade.wanted import Wanted
from hooks.media import memory as projector_memory
from hooks.slots import view_of
from wrapper.configuration import argv as args
from wrapper.configuration.sections import SLEEP
from wrapper.configuration.units import format_size
from wrapper.server.generation import Generation, Host

log = structlog.get_logger()


def _free(generation: Generation) -> int:
    pool = member.pool_of_generation(generation)
    assert pool is not None
    with pool.locked() as held:
        return held.free(os.getpid())


def _device(fit: Fitted) -> str:
    first = fit.rungs[0].plan
    return first.budget_device if first is not None else "CPU"


async def grow(host: Host, state: DegradeState, fit: Fitted, wanted: int, why: str) -> str | None:
    """Grow to `wanted` tokens of context: what the rung that runs needs beyond what is free is asked of the
    others first; then the best rung that fits what is free now. None when grown, else why not."""
    generation = host.current
    settings = DEGRADE.of(generation.config)
    pool = member.pool_of(settings)
    assert pool is not None
    free = _free(generation)
    planner, rungs = ladder_for(fit.rungs[0].argv, generation.launch, generation.config, state, free)
    need = planner.plan(fit.rungs[fit.index].argv, wanted).total(_device(fit))
    asked = None
    if need > free:
        asked = await member.ask(pool, member.record(generation, fit, busy=True), need - free, settings.pool_wait)
        free = _free(host.current)
        planner, rungs = ladder_for(fit.rungs[0].argv, generation.launch, generation.config, state, free)
    plan = plan_growth(0, wanted, rungs)  # what is free now plans the rung: the one it runs may no longer fit
    if isinstance(plan, TooLarge):
        got = f"; the others gave {format_size(asked.given)} of {format_size(asked.asked)} asked" if asked else ""
        return (f"{why}: the pool {pool.dir} has {format_size(free)} for this member{got}, which holds at most "
                f"{plan.largest} tokens of context (rung {plan.rung or '-'}); give the pool more memory "
                "(degrade.budget) or shorten the conversation")
    assert isinstance(plan, GrowTo)
    problem = await move(host, state, Wanted(rung=plan.rung, ctx=wanted),
                         f"{why} ({format_size(free)} for it in the pool)")
    member.publish(host.current, busy=True)  # what runs now, whether the move took effect or not
    return problem


async def give(host: Host, asked: Request) -> None:
    """Another member asked for `asked.bytes`: give them up in the ladder's order (an unused projector, the
    draft, K/V precision, then context only idle conversations hold), never below the floor; a request in
    flight is left to finish first: a give never cuts an answer (it is refused if they outlast the drain)."""
    began = time.monotonic()
    generation = host.current
    pool = member.pool_of_generation(generation)
    fit = fitted(generation.launch)
    assert pool is not None
    if asked.kind == "sleep":
        await _sleep_for(host, pool, asked)
        return
    if fit is None:
        await member.answer(pool, asked, "refused", 0, "this member runs without a plan", 0.0)
        return
    state = state_of(generation.shared)
    settings = DEGRADE.of(generation.config)
    running = Running.of(fit)
    base = fit.rungs[0].argv
    projector = projector_memory.gives_up(generation.shared, generation.config) and args.has(base, args.MMPROJ)
    if projector:
        base = args.remove(base, args.MMPROJ)
    planner, rungs = ladder_for(base, generation.launch, generation.config, state,
                                give_limit(running, asked.bytes))
    serving = None
    if host.in_flight:  # it serves requests: it keeps what its conversations hold (the reload lets them finish)
        held = list(view_of(generation).held().values())
        serving = context_for(generation.launch.argv, held, [t + settings.headroom for t in held])
    smallest = smallest_context(planner.ceiling, settings.context, serving, fit.n_ctx)
    plan = plan_give(running, asked.bytes, rungs, smallest)
    if isinstance(plan, Refuse):
        await member.answer(pool, asked, "refused", 0, plan.reason, _since(began))
        return
    state.giving = True  # its own climb back waits: what it frees is the asker's once answered
    try:
        problem = await move(host, state, Wanted(rung=plan.rung, ctx=plan.ctx, limit=plan.limit),
                             f"give {format_size(asked.bytes)} to {asked.asker_model}[{asked.asker}]", cut=False)
        now = fitted(host.current.launch) or fit
        given = max(0, fit.share - now.share) if problem is None else 0
        member.publish(host.current, host.in_flight > 0)
        state.gave = state.gave or given > 0
        what = _what(fit, now, projector) if problem is None else str(problem)
        await member.answer(pool, asked, "given" if given else "refused", given, what, _since(began))
    finally:
        state.giving = False


async def _sleep_for(host: Host, pool: Pool, asked: Request) -> None:
    """Asked to sleep (the pool's last rung): fall asleep if still idle long enough; the answer goes once the
    server has stopped (`slept`), with the whole share."""
    when_asked = SLEEP.of(host.current.config).when_asked
    why = f"the pool: {asked.asker_model}[{asked.asker}] needs {format_size(asked.bytes)} more than the ladders give"
    if when_asked is None or not host.sleep_soon(why, when_asked):
        await member.answer(pool, asked, "refused", 0, "it is not idle for sleep.when_asked now", 0.0)
        return
    state_of(host.current.shared).sleep_asks.append(asked)


def slept(generation: Generation, asleep: bool) -> None:
    """llama-server stopped for a sleep: the share goes to those that asked for it; about to wake: the next fit
    takes what it needs as at a start (asking the others, and as a last rung idle ones to sleep)."""
    pool = member.pool_of_generation(generation)
    state = state_of(generation.shared)
    if pool is None:
        return
    if asleep:
        fit = fitted(generation.launch)
        asks, state.sleep_asks = state.sleep_asks, []
        member.fell_asleep(pool, asks, fit.share if fit is not None else 0)
        log.info("pool.asleep", share=0, gave=sum(a.given for a in asks),
                 message="asleep: this member's share is free until it wakes")
    else:
        state.started = False  # the wake fits as a start: it asks for what its conversations need


def _what(before: Fitted, after: Fitted, projector: bool) -> str:
    parts = ["the projector"] if projector else []
    if after.rung != before.rung:
        parts.append(f"rung {before.rung} -> {after.rung}")
    if after.n_ctx != before.n_ctx:
        parts.append(f"n_ctx {before.n_ctx} -> {after.n_ctx}")
    return ", ".join(parts) or "nothing"


def _since(began: float) -> float:
    return round(time.monotonic() - began, 3)


async def relax(host: Host, state: DegradeState, needed: int, why: str) -> str | None:
    """Take what this member wants at rest from what the pool has free now: the best rung at its resting context
    (`degrade.context`, or what the conversations in flight hold), and the projector back if it was given up.
    An asker gives back the context it grew for; a giver climbs back. None when nothing had to change."""
    generation = host.current
    fit = fitted(generation.launch)
    if fit is None:
        return None
    settings = DEGRADE.of(generation.config)
    free = _free(generation)
    base = fit.rungs[0].argv
    back = not args.has(base, args.MMPROJ) and projector_memory.takes_back(generation.shared, generation.config)
    if back and (projector := args.get(generation.config.argv, args.MMPROJ)):
        base = [*base, "--mmproj", projector]
    looked = (free, needed, back, fit.rung, fit.n_ctx, fit.share)
    if looked == state.looked:
        return None  # nothing changed since the last look, which moved nothing: no planning every second
    state.looked = looked
    planner, rungs = ladder_for(base, generation.launch, generation.config, state, free)
    wanted = resting_context(planner.ceiling, settings.context, needed)

    def without() -> list[RungPlan]:
        return rungs if not back else ladder_for(fit.rungs[0].argv, generation.launch, generation.config, state,
                                                 free)[1]

    plan = plan_climb(Running.of(fit), [r.name for r in fit.rungs], wanted, rungs if back else None, without)
    if isinstance(plan, Stay):
        if plan.index is not None:
            state.gave = state.gave and plan.index > 0
        return None
    problem = await move(host, state, Wanted(rung=plan.rung, ctx=plan.ctx, up=True, projector=plan.projector),
                         f"relax to {plan.rung}, n_ctx {plan.ctx} ({why}; the pool has {format_size(free)} free "
                         "for it)",
                         cut=False)
    member.publish(host.current, busy=False)  # what runs now, whether the move took effect or not
    if problem is not None:
        state.climb_after = time.monotonic() + settings.relax_after  # not again at once: each try is a reload
        state.looked = None  # the same look tries again then
    else:
        now = fitted(host.current.launch)
        state.gave = now is not None and now.index > 0
        log.info("pool.back", rung=now.rung if now else None, n_ctx=now.n_ctx if now else None,
                 share=now.share if now else None, why=why)
    return problem
