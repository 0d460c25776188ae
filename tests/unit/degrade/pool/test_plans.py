"""A pool member's decisions, without a llama-server or a pool: what it gives when asked, where it climbs back."""

from __future__ import annotations

import pytest

from hooks.degrade.ladder import RungPlan
from hooks.degrade.pool.plans import (
    NOTHING_TO_GIVE,
    Climb,
    Give,
    Refuse,
    Running,
    Stay,
    give_limit,
    plan_climb,
    plan_give,
    resting_context,
    smallest_context,
)

MiB = 1 << 20


def ladder(*contexts: int, skipped: tuple[str, ...] = ()) -> list[RungPlan]:
    """Rungs best first, each holding at most this many tokens under the budget planned (0: none fits)."""
    names = ["best", "disable-spec", "quantize-kv-q8", "quantize-kv-q4"]
    return [RungPlan(names[i], ["llama-server"], ctx, skipped="skip" if names[i] in skipped else None)
            for i, ctx in enumerate(contexts)]


RUNNING = Running("best", 0, 8192, share=800 * MiB, floor=300 * MiB)


@pytest.mark.parametrize(("asked", "expected"), [
    (100 * MiB, 700 * MiB),  # it keeps the rest
    (500 * MiB, 300 * MiB),  # exactly down to its floor
    (900 * MiB, 300 * MiB),  # more than it could spare: never below its floor
])
def test_a_giver_keeps_at_least_its_floor(asked: int, expected: int) -> None:
    assert give_limit(RUNNING, asked) == expected


@pytest.mark.parametrize(("running", "rungs", "smallest", "expected"), [
    # the best rung that keeps its context: a cheaper K/V at the same 8k
    (RUNNING, ladder(4096, 4096, 8192, 16384), 1024, Give("quantize-kv-q8", 8192, 700 * MiB)),
    # none keeps 8k: the best that keeps the least it must, at that rung's largest context
    (RUNNING, ladder(4096, 2048, 3072, 6144), 1024, Give("best", 4096, 700 * MiB)),
    # a rung that does not apply is passed over
    (RUNNING, ladder(8192, 8192, skipped=("best",)), 1024, Give("disable-spec", 8192, 700 * MiB)),
    # serving a conversation of 5k tokens: a rung of 4k would cut it
    (RUNNING, ladder(4096, 4096, 4096, 4096), 5120, Refuse(NOTHING_TO_GIVE)),
    # at its floor already: nothing to give, whatever the ladder says
    (Running("best", 0, 8192, 300 * MiB, 300 * MiB), ladder(8192), 1024, Refuse(NOTHING_TO_GIVE)),
    # no rung fits what it would keep
    (RUNNING, ladder(0, 0), 1024, Refuse(NOTHING_TO_GIVE)),
])
def test_what_a_member_gives(running: Running, rungs: list[RungPlan], smallest: int, expected: Give | Refuse) -> None:
    assert plan_give(running, 100 * MiB, rungs, smallest) == expected


@pytest.mark.parametrize(("ceiling", "context", "serving", "n_ctx", "expected"), [
    (32768, 4096, None, 8192, 1024),  # idle: the start's context, at most MIN_START_CTX
    (32768, 512, None, 8192, 512),  # a smaller degrade.context
    (32768, 0, None, 8192, 1024),  # 0: MIN_START_CTX
    (800, 4096, None, 8192, 800),  # never past the ceiling
    (32768, 4096, 3000, 8192, 3072),  # serving: what its conversations hold, in whole cells
    (32768, 4096, 20000, 8192, 8192),  # never more than it runs
])
def test_the_least_context_a_giver_keeps(ceiling: int, context: int, serving: int | None, n_ctx: int,
                                         expected: int) -> None:
    assert smallest_context(ceiling, context, serving, n_ctx) == expected


@pytest.mark.parametrize(("ceiling", "context", "needed", "expected"), [
    (32768, 4096, 0, 4096),  # at rest: degrade.context
    (32768, 0, 0, 1024),  # 0: MIN_START_CTX
    (32768, 4096, 6000, 6144),  # what the conversations in flight need, in whole cells
    (5000, 4096, 6000, 5000),  # never past the ceiling
])
def test_the_context_a_member_takes_at_rest(ceiling: int, context: int, needed: int, expected: int) -> None:
    assert resting_context(ceiling, context, needed) == expected


NAMES = ["best", "disable-spec", "quantize-kv-q8", "quantize-kv-q4"]


def never() -> list[RungPlan]:
    raise AssertionError("the ladder without the projector was planned for nothing")


@pytest.mark.parametrize(("running", "wanted", "with_projector", "without", "expected"), [
    # a giver below its best: memory is free again, back to the best rung
    (Running("quantize-kv-q8", 2, 4096, 0, 0), 4096, None, ladder(4096, 8192), Climb("best", 4096, False)),
    # where it is already, at the context it wants: nothing to change
    (Running("best", 0, 4096, 0, 0), 4096, None, ladder(8192), Stay(0)),
    # an asker gives back the context it grew for
    (Running("best", 0, 16384, 0, 0), 4096, None, ladder(16384), Climb("best", 4096, False)),
    # within a cell's padding of what runs: not worth a reload
    (Running("best", 0, 4096, 0, 0), 4100, None, ladder(8192), Stay(0)),
    # still not enough free for anything better than what runs
    (Running("quantize-kv-q8", 2, 4096, 0, 0), 4096, None, ladder(1024, 2048, 4096), Stay(2)),
    # nothing fits what is free
    (Running("quantize-kv-q8", 2, 4096, 0, 0), 4096, None, ladder(0, 0, 0), Stay(None)),
    # the projector comes back at the best rung
    (Running("best", 0, 4096, 0, 0), 4096, ladder(4096), never, Climb("best", 4096, True)),
])
def test_where_a_member_climbs(running: Running, wanted: int, with_projector: list[RungPlan] | None,
                               without: list[RungPlan] | object, expected: Climb | Stay) -> None:
    plan_without = without if callable(without) else (lambda: without)
    assert plan_climb(running, NAMES, wanted, with_projector, plan_without) == expected  # type: ignore[arg-type]


def test_the_projector_waits_for_the_next_image_rather_than_cost_a_rung() -> None:
    running = Running("quantize-kv-q8", 2, 4096, 0, 0)
    planned: list[str] = []

    def without() -> list[RungPlan]:
        planned.append("without")
        return ladder(4096, 8192)

    assert plan_climb(running, NAMES, 4096, ladder(2048, 4096), without) == Climb("best", 4096, False)
    assert planned == ["without"]
