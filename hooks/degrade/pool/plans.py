"""A pool member's decisions, as pure functions: what it gives when another member asks, and where it climbs back
when memory is free. Their inputs are what the member runs (`Running`), what it is asked or wants, and the
ladder planned under the budget it would have; hooks/degrade/pool/moves.py takes the pool's lock, plans the
ladder, asks these, and makes the move. tests/unit/degrade/pool/test_plans.py holds their tables."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hooks.degrade.ladder import RungPlan, choose
from hooks.degrade.memory import CELL_PAD
from hooks.degrade.planning import MIN_START_CTX, cells
from hooks.degrade.state import Fitted

NOTHING_TO_GIVE = "nothing to give above its floor"


@dataclass(frozen=True)
class Running:
    """What a member runs now: its rung (and where it is on the ladder), context, share of the pool, floor."""

    rung: str
    index: int
    n_ctx: int
    share: int
    floor: int

    @classmethod
    def of(cls, fit: Fitted) -> Running:
        return cls(fit.rung, fit.index, fit.n_ctx, fit.share, fit.floor)


@dataclass(frozen=True)
class Give:
    """Run `rung` at `ctx`, taking at most `limit` bytes of the pool: the rest goes to the asker."""

    rung: str
    ctx: int
    limit: int


@dataclass(frozen=True)
class Refuse:
    reason: str


@dataclass(frozen=True)
class Climb:
    """Move up to `rung` at `ctx`, with the projector back when `projector`."""

    rung: str
    ctx: int
    projector: bool


@dataclass(frozen=True)
class Stay:
    """Nothing to change: `index` is where the rung it would choose is on its ladder (None: none fits)."""

    index: int | None


def give_limit(running: Running, asked: int) -> int:
    """What the member may keep once it gave `asked` bytes: never less than its floor."""
    return max(running.floor, running.share - asked)


def smallest_context(ceiling: int, context: int, serving: int | None, n_ctx: int) -> int:
    """The least context a giver keeps: its resting context (`degrade.context`, at most MIN_START_CTX), and while
    it serves requests what their conversations hold (`serving`: tokens), up to what it runs now."""
    smallest = min(ceiling, context or MIN_START_CTX, MIN_START_CTX)
    if serving is not None:
        smallest = min(n_ctx, max(smallest, cells(serving)))
    return smallest


def plan_give(running: Running, asked: int, rungs: Sequence[RungPlan], smallest: int) -> Give | Refuse:
    """`rungs`: the ladder planned under `give_limit(running, asked)`. The best rung that keeps the context it runs,
    else the best that keeps `smallest`; refused when none does or its floor leaves nothing to give."""
    limit = give_limit(running, asked)
    target = choose(rungs, running.n_ctx) or choose(rungs, smallest)
    if target is None or limit >= running.share:
        return Refuse(NOTHING_TO_GIVE)
    return Give(target.name, min(target.max_ctx, running.n_ctx), limit)


def resting_context(ceiling: int, context: int, needed: int) -> int:
    """The context a member takes at rest: `degrade.context` (MIN_START_CTX if 0), or what the conversations in
    flight need (`needed`) when that is more; never past the ceiling."""
    rest = min(ceiling, context or MIN_START_CTX)
    return min(ceiling, cells(max(rest, needed)))


def plan_climb(running: Running, names: Sequence[str], wanted: int, with_projector: Sequence[RungPlan] | None,
               without: Callable[[], Sequence[RungPlan]]) -> Climb | Stay:
    """Where a member climbs at `wanted` tokens of context with what the pool has free: `with_projector`, the
    ladder planned with the projector given up for memory back (None when it is not to come back); `without`,
    the ladder as it runs (planned only when needed). The projector comes back only at the best rung: if it
    would cost one, it waits for the next image instead. `names`: the rungs of the ladder it runs."""
    back = with_projector is not None
    rungs = with_projector if with_projector is not None else without()
    target = choose(rungs, wanted)
    if back and target is not None and target.name != rungs[0].name:
        back = False
        target = choose(without(), wanted)
    if target is None:
        return Stay(None)
    index = list(names).index(target.name)
    if index == running.index and abs(wanted - running.n_ctx) < CELL_PAD and not back:
        return Stay(index)
    return Climb(target.name, wanted, back)
