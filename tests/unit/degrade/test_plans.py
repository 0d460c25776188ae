"""Degrade's growth and relax decisions, without a llama-server: how much context the waiting requests need,
which rung holds it, where an idle wrapper relaxes to."""

from __future__ import annotations

import pytest

from hooks.degrade.ladder import RungPlan
from hooks.degrade.plans import GrowTo, Holds, TooLarge, plan_growth, plan_relax, wanted_context


def ladder(*contexts: int) -> list[RungPlan]:
    names = ["best", "disable-spec", "quantize-kv-q8", "quantize-kv-q4"]
    return [RungPlan(names[i], ["llama-server"], ctx) for i, ctx in enumerate(contexts)]


@pytest.mark.parametrize(("n_ctx", "wanted", "rungs", "expected"), [
    (4096, 3000, ladder(4096, 8192), Holds()),  # another request's growth got there first
    (4096, 6000, ladder(8192, 16384), GrowTo("best", 8192)),  # the best rung that holds it
    (4096, 10000, ladder(8192, 8192, 16384), GrowTo("quantize-kv-q8", 16384)),  # the first that holds it
    (4096, 40000, ladder(8192, 16384), TooLarge(16384, "disable-spec")),  # says the largest there is
    (4096, 40000, [], TooLarge(0, None)),
])
def test_how_far_a_growth_goes(n_ctx: int, wanted: int, rungs: list[RungPlan],
                               expected: Holds | GrowTo | TooLarge) -> None:
    assert plan_growth(n_ctx, wanted, rungs) == expected


@pytest.mark.parametrize(("argv", "held", "waiting", "pool_full", "expected"), [
    (["-np", "1"], [], [3000], False, 3000),
    (["-np", "2"], [1000], [3000, 500], False, 6000),  # a KV per slot: the largest demand times -np
    (["-np", "2", "-kvu"], [1000, 700], [3000], False, 3700),  # one KV: the demand beside the other slot
    (["-np", "2", "-kvu"], [], [100], True, 4097),  # the shared KV ran out: at least the next larger context
])
def test_the_context_the_waiting_requests_need(argv: list[str], held: list[int], waiting: list[int],
                                               pool_full: bool, expected: int) -> None:
    assert wanted_context(["llama-server", *argv], held, waiting, pool_full, 4096) == expected


@pytest.mark.parametrize(("index", "n_ctx", "needed", "expected"), [
    (2, 4096, 2000, "best"),  # idle: back up to the best rung that holds what is kept
    (0, 4096, 2000, None),  # at the best already, with as much context
    (0, 2048, 3000, "best"),  # the best rung again, with more context
    (2, 4096, 9000, "quantize-kv-q8"),  # only its own rung holds them: the same rung, its largest context
    (2, 16384, 9000, None),  # which it runs already
    (0, 4096, 20000, None),  # nothing holds them
])
def test_where_an_idle_wrapper_relaxes_to(index: int, n_ctx: int, needed: int, expected: str | None) -> None:
    target = plan_relax(index, n_ctx, ladder(4096, 4096, 16384), needed)
    assert (target.name if target is not None else None) == expected
