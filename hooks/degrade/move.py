"""One move along the ladder: a reload that asks the next fit for a rung (a context, a budget); the state in force
changes only when that reload succeeds."""

from __future__ import annotations

import time

import structlog

from hooks.degrade.state import DegradeState, fitted
from hooks.degrade.wanted import Wanted
from wrapper.reload_ask import NotReloaded, RolledBack, Unchanged, ask_reload
from wrapper.server.generation import Host

log = structlog.get_logger()


async def move(host: Host, state: DegradeState, ask: Wanted, why: str, cut: bool = True) -> str | None:
    """Reload to what `ask` asks for; None when done (or nothing had to change), else why not. The rung and
    budget in force change only when the reload succeeds. Not `cut`: a move no request waits for (giving memory
    to another member, a relax) leaves every answer in flight to finish, and is given up if they outlast the
    drain."""
    began = time.monotonic()
    asked = await ask_reload(host, f"degrade: {why}", ask.as_asks(), cut=cut)
    if isinstance(asked, Unchanged):
        commit(state, ask)
        return None
    if isinstance(asked, NotReloaded):
        return asked.reason
    answer = asked.answer
    fit = fitted(host.current.launch)
    rolled_back = isinstance(asked, RolledBack)
    step = {"at": time.time(), "why": why, "success": not rolled_back, "rung": fit.rung if fit else None,
            "n_ctx": answer.get("n_ctx"), "share": fit.share if fit else None, "downtime_ms": answer.get("downtime_ms"),
            "wait_s": round(time.monotonic() - began, 3), "restore": answer.get("restore")}
    state.steps.append(step)
    log.info("degrade.step", **step)
    if isinstance(asked, RolledBack):
        return f"the reload failed: {asked.reason}"
    commit(state, ask)
    return None


def commit(state: DegradeState, ask: Wanted) -> None:
    if ask.rung is not None:
        state.rung_in_force = ask.rung
    if ask.budget is not None:
        state.budget, state.budget_source = ask.budget
