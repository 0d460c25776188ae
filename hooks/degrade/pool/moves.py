"""The moves of a pool member (`degrade.pool`): a growth that asks the others for what is not free, giving
when another asks, and climbing back when memory is free again. Each is a move (hooks/degrade/move.py) whose
fit takes its share of the pool (hooks/degrade/fit.py)."""

from __future__ import annotations

import os
import time

import structlog

from hooks.degrade.ladder import choose
from hooks.degrade.memory import CELL_PAD
from hooks.degrade.move import move
from hooks.degrade.planning import MIN_START_CTX, cells, ladder_for
from hooks.degrade.pool import member as share
from hooks.degrade.pool.folder import Request
from hooks.degrade.settings import DEGRADE
from hooks.degrade.state import DegradeState, Fitted, context_for, fitted, state_of
from hooks.degrade.wanted import Wanted
from hooks.media import memory as projector_memory
from wrapper import argv as args
from wrapper.generation import Generation, Host
from wrapper.units import format_size

log = structlog.get_logger()


def _free(generation: Generation) -> int:
    pool = share.pool_of_generation(generation)
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
    pool = share.pool_of(settings)
    assert pool is not None
    free = _free(generation)
    planner, rungs = ladder_for(fit.rungs[0].argv, generation.launch, generation.config, state, free)
    need = planner.plan(fit.rungs[fit.index].argv, wanted).total(_device(fit))
    asked = None
    if need > free:
        asked = await share.ask(pool, share.record(generation, fit, busy=True), need - free, settings.pool_wait)
        free = _free(host.current)
        planner, rungs = ladder_for(fit.rungs[0].argv, generation.launch, generation.config, state, free)
    target = choose(rungs, wanted)
    if target is None:
        got = f"; the others gave {format_size(asked.given)} of {format_size(asked.asked)} asked" if asked else ""
        best = max(rungs, key=lambda r: r.max_ctx, default=None)
        return (f"{why}: the pool {pool.dir} has {format_size(free)} for this member{got}, which holds at most "
                f"{best.max_ctx if best else 0} tokens of context (rung {best.name if best else '-'}); give the pool "
                "more memory (degrade.budget) or shorten the conversation")
    problem = await move(host, state, Wanted(rung=target.name, ctx=wanted),
                         f"{why} ({format_size(free)} for it in the pool)")
    share.publish(host.current, busy=True)  # what runs now, whether the move took effect or not
    return problem


async def give(host: Host, asked: Request) -> None:
    """Another member asked for `asked.bytes`: give them up in the ladder's order (an unused projector, the
    draft, K/V precision, then context only idle conversations hold), never below the floor; a request in
    flight is drained first by the reload."""
    began = time.monotonic()
    generation = host.current
    pool = share.pool_of_generation(generation)
    fit = fitted(generation.launch)
    assert pool is not None
    if fit is None:
        await share.answer(pool, asked, "refused", 0, "this member runs without a plan", 0.0)
        return
    state = state_of(generation.shared)
    settings = DEGRADE.of(generation.config)
    limit = max(fit.floor, fit.share - asked.bytes)
    base = fit.rungs[0].argv
    projector = projector_memory.gives_up(generation.shared, generation.config) and args.has(base, args.MMPROJ)
    if projector:
        base = args.remove(base, args.MMPROJ)
    planner, rungs = ladder_for(base, generation.launch, generation.config, state, limit)
    smallest = min(planner.ceiling, settings.context or MIN_START_CTX, MIN_START_CTX)
    if host.in_flight:  # it serves requests: it keeps what its conversations hold (the reload drains them first)
        held = [t + settings.headroom for t in state.conversation.values()]
        smallest = min(fit.n_ctx, max(smallest, cells(context_for(generation.launch.argv, state, held))))
    target = choose(rungs, fit.n_ctx) or choose(rungs, smallest)
    if target is None or limit >= fit.share:
        await share.answer(pool, asked, "refused", 0, "nothing to give above its floor", _since(began))
        return
    ctx = min(target.max_ctx, fit.n_ctx)
    state.giving = True  # its own climb back waits: what it frees is the asker's once answered
    try:
        problem = await move(host, state, Wanted(rung=target.name, ctx=ctx, limit=limit),
                             f"give {format_size(asked.bytes)} to {asked.asker_model}[{asked.asker}]")
        now = fitted(host.current.launch) or fit
        given = max(0, fit.share - now.share) if problem is None else 0
        share.publish(host.current, host.in_flight > 0)
        state.gave = state.gave or given > 0
        what = _what(fit, now, projector) if problem is None else str(problem)
        await share.answer(pool, asked, "given" if given else "refused", given, what, _since(began))
    finally:
        state.giving = False


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
    rest = min(planner.ceiling, settings.context or MIN_START_CTX)
    wanted = min(planner.ceiling, cells(max(rest, needed)))
    target = choose(rungs, wanted)
    if back and target is not None and target.name != rungs[0].name:
        back = False  # the projector would cost a rung: it comes back with the first image instead
        base = fit.rungs[0].argv
        planner, rungs = ladder_for(base, generation.launch, generation.config, state, free)
        target = choose(rungs, wanted)
    if target is None:
        return None
    index = [r.name for r in fit.rungs].index(target.name)
    same = index == fit.index and abs(wanted - fit.n_ctx) < CELL_PAD
    if same and not back:
        state.gave = state.gave and index > 0
        return None
    problem = await move(host, state, Wanted(rung=target.name, ctx=wanted, up=True, projector=back),
                         f"relax to {target.name}, n_ctx {wanted} ({why}; {format_size(free)} for it in the pool)")
    share.publish(host.current, busy=False)  # what runs now, whether the move took effect or not
    if problem is not None:
        state.climb_after = time.monotonic() + settings.relax_after  # not again at once: each try is a reload
        state.looked = None  # the same look tries again then
    else:
        now = fitted(host.current.launch)
        state.gave = now is not None and now.index > 0
        log.info("pool.back", rung=now.rung if now else None, n_ctx=now.n_ctx if now else None,
                 share=now.share if now else None, why=why)
    return problem
