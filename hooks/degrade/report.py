"""What a generation under degradation reports: its buffer lines to the calibration, the activity the relax
watches, its part of /wrapper/status and GET /wrapper/memory."""

from __future__ import annotations

import os
import time
from typing import Any

import structlog

from hooks.degrade import calibration
from hooks.degrade.pool import member
from hooks.degrade.state import fitted, measuring, state_of
from wrapper.metrics import METRICS
from wrapper.server.generation import Generation, Host
from wrapper.steps import Observer

log = structlog.get_logger()


def server_line(generation: Generation, line: str) -> bool:
    """Feed the start-up buffer lines to the calibration; False for the lines -lv 4 added that are not news."""
    found = measuring(generation)
    fit = fitted(generation.launch)
    if not found.measured.done:
        found.measured.feed(line)
        if found.measured.done and not found.remembered and fit is not None:
            found.remembered = True
            calibration.remember(generation.launch.model.id, found.measured, fit.choices)
            log.info("degrade.measured", n_ctx=found.measured.n_ctx, buffers=found.measured.buffers)
    # The lines -lv 4 adds are the wrapper's own business (debug); the server's own news and its warnings are not.
    return fit is None or not fit.verbosity_added or " I srv " in line or " W " in line or " E " in line


def observer(generation: Generation) -> Observer:
    state = state_of(generation.shared)

    def seen(path: str, status: int, tail: bytes) -> None:
        state.last_activity = time.monotonic()

    return seen


def status(generation: Generation) -> dict[str, Any]:
    state = state_of(generation.shared)
    fit = fitted(generation.launch)
    total = _pool_total(generation)
    return {
        "budget": total if total is not None else fit.budget if fit else state.budget,
        "budget_source": fit.budget_source if fit else "",
        "rung": fit.rung if fit else None, "n_ctx": fit.n_ctx if fit else None,
        "ladder": [r.as_dict() for r in fit.rungs] if fit else [],
        "pool": {"dir": fit.pool, "share": fit.share, "floor": fit.floor, "available": fit.budget, "gave": state.gave}
        if fit and fit.pool else None,
        "steps": state.steps[-20:],
        "swa_window_note": ("the sliding-window cache is not full: restored slots would not be reused, so the "
                            "slots saved with it are kept") if fit and fit.swa_dropped else None,
    }


def _pool_total(generation: Generation) -> int | None:
    """A pool member's budget is the pool's total, as for every member (what the pool had free for it at its last
    fit is its `available`); None outside a pool."""
    fit = fitted(generation.launch)
    pool = member.pool_of_generation(generation) if fit is not None and fit.pool else None
    if pool is None:
        return None
    with pool.locked() as held:
        return int(held.total)


def metrics(generation: Generation) -> None:
    fit = fitted(generation.launch)
    total = _pool_total(generation)
    METRICS.degrade(fit.rung if fit else None, fit.n_ctx if fit else None,
                    total if total is not None else fit.budget if fit else None)
    pool = member.pool_of_generation(generation)
    if pool is not None and fit is not None:
        with pool.locked() as held:
            members = held.members()
            METRICS.pool_total.set(held.total)
        METRICS.pool_used.set(sum(m.share for m in members))
        METRICS.pool_members.set(len(members))
        METRICS.pool_share.set(fit.share)
        for role in ("asked", "gave"):  # each counter is there from the first scrape, at 0 until a move
            METRICS.pool_moves.labels(role=role)


def memory(generation: Generation) -> dict[str, Any]:
    """GET /wrapper/memory: planned and measured bytes per device and component."""
    fit = fitted(generation.launch)
    chosen = next((r for r in fit.rungs if r.name == fit.rung), None) if fit else None
    measured = measuring(generation).measured
    planned = chosen.plan.as_dict() if chosen is not None and chosen.plan is not None else None
    pool = member.pool_of_generation(generation) if fit is not None and fit.pool else None
    if pool is not None:
        with pool.locked() as held:
            pooled: dict[str, Any] | None = {**held.summary(), "me": os.getpid()}
    else:
        pooled = None
    return {
        "budget": {"bytes": pooled["total"] if pooled else fit.budget if fit else None,
                   "source": fit.budget_source if fit else None,
                   "device": planned["budget_device"] if planned else None,
                   **({"available": fit.budget} if pooled and fit else {})},
        "pool": pooled,
        "rung": fit.rung if fit else None, "n_ctx": fit.n_ctx if fit else None,
        "planned": planned,
        "measured": {"n_ctx": measured.n_ctx, "devices": {d: {**parts, "total": sum(parts.values())}
                                                           for d, parts in measured.devices.items()},
                     "buffers": measured.buffers, "complete": measured.done},
    }


async def memory_route(host: Host, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 200, memory(host.current)
