"""Degrade's decisions as pure functions: how much context the requests waiting for a growth need, which rung
holds it, and where an idle member relaxes to. hooks/degrade/control.py (and a pool member's moves) take the lock,
ask these and make the move; tests/unit/degrade/test_plans.py holds their tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hooks.degrade.ladder import RungPlan, choose
from hooks.degrade.state import context_for


@dataclass(frozen=True)
class Holds:
    """The context holds it already (another request's growth got there first)."""


@dataclass(frozen=True)
class GrowTo:
    rung: str
    n_ctx: int


@dataclass(frozen=True)
class TooLarge:
    """No rung holds it under the budget: the largest context there is, and its rung."""

    largest: int
    rung: str | None


def wanted_context(argv: Sequence[str], held: Sequence[int], waiting: Sequence[int], pool_full: bool,
                   n_ctx: int) -> int:
    """The -c that holds every request waiting for a growth beside what the other slots hold; when the slots'
    shared KV ran out (`pool_full`) at least the next larger context."""
    wanted = context_for(argv, held, waiting)
    return max(wanted, n_ctx + 1) if pool_full else wanted


def plan_growth(n_ctx: int, wanted: int, rungs: Sequence[RungPlan]) -> Holds | GrowTo | TooLarge:
    """The first rung whose context reaches `wanted` tokens (the ladder's order is its preference)."""
    if n_ctx >= wanted:
        return Holds()
    target = choose(rungs, wanted)
    if target is not None:
        return GrowTo(target.name, target.max_ctx)
    best = max(rungs, key=lambda r: r.max_ctx, default=None)
    return TooLarge(best.max_ctx if best else 0, best.name if best else None)


def plan_relax(index: int, n_ctx: int, rungs: Sequence[RungPlan], needed: int) -> RungPlan | None:
    """The best rung that holds `needed` tokens, when it is better than the one that runs (higher on the ladder,
    or the same with more context); None: stay."""
    target = choose(rungs, needed)
    if target is None or (list(rungs).index(target) >= index and target.max_ctx <= n_ctx):
        return None
    return target
