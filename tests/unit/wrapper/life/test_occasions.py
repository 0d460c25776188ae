"""The occasions of llama-server's life as a table: what each way up and each way down does."""

from __future__ import annotations

import pytest

from wrapper.life.occasions import DOWN, UP, Occasion, down, up
from wrapper.lifecycle import _ALLOWED, State


@pytest.mark.parametrize(("occasion", "held", "fits", "will_start", "asleep", "spends"), [
    (Occasion.START, State.STARTING, False, True, False, False),  # the launch was fitted before the first spawn
    (Occasion.RESTART, State.RESTARTING, False, False, False, True),  # the same argv again; one of the budget
    (Occasion.WAKE, State.WAKING, True, True, True, False),  # fitted again: a pool member takes its share back
])
def test_each_way_up(occasion: Occasion, held: State, fits: bool, will_start: bool, asleep: bool,
                     spends: bool) -> None:
    recipe = up(occasion)
    assert (recipe.held, recipe.fits, recipe.will_start, recipe.asleep, recipe.spends) == \
        (held, fits, will_start, asleep, spends)


@pytest.mark.parametrize(("occasion", "held", "cuts", "stops", "asleep", "then"), [
    (Occasion.STOP, State.STOPPING, True, True, False, State.STOPPED),
    (Occasion.SLEEP, State.SLEEPING, False, True, True, State.ASLEEP),  # a drain that does not finish: given up
    (Occasion.DRAIN, State.DRAINING, True, False, False, None),  # the stop that follows stops llama-server
])
def test_each_way_down(occasion: Occasion, held: State, cuts: bool, stops: bool, asleep: bool,
                       then: State | None) -> None:
    recipe = down(occasion)
    assert (recipe.held, recipe.cuts, recipe.stops, recipe.asleep, recipe.then) == (held, cuts, stops, asleep, then)


def test_every_occasion_is_one_way_and_the_states_allow_its_moves() -> None:
    assert set(UP) | set(DOWN) == set(Occasion) and not set(UP) & set(DOWN)
    for recipe in UP.values():  # requests are held while it comes up, and it ends ready
        assert recipe.held is not State.READY and State.READY in _ALLOWED[recipe.held]
    assert State.STARTING in _ALLOWED[State.STOPPED]
    assert State.RESTARTING in _ALLOWED[State.READY] and State.WAKING in _ALLOWED[State.ASLEEP]
    for way_down in DOWN.values():
        assert way_down.held in _ALLOWED[State.READY]
        assert way_down.then is None or way_down.then in _ALLOWED[way_down.held]
    assert State.READY in _ALLOWED[State.SLEEPING]  # a sleep given up


def test_a_way_up_is_not_a_way_down() -> None:
    with pytest.raises(KeyError):
        up(Occasion.STOP)
    with pytest.raises(KeyError):
        down(Occasion.WAKE)
