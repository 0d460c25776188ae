"""The built-in interface: the order is what `after` declares (never where a built-in is written), the built-ins
a generation uses are settled once, and what built-ins keep is typed."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import pytest

from hooks.registry import BUILTINS, Builtin, ordered
from wrapper import built_ins
from wrapper.configuration.config import Config
from wrapper.kept import Kept, Key
from wrapper.server.generation import Generation


def test_the_order_is_the_declared_one_whatever_the_tuple_says() -> None:
    orders = {tuple(b.family for b in ordered(tuple(each))) for each in itertools.permutations(BUILTINS)}
    assert len(orders) == 1
    (order,) = orders
    assert order.index("slots") < order.index("degrade")  # degrade fits what the slot built-ins made fit
    assert order.index("slots") < order.index("conversations")


def test_an_order_that_cannot_be_kept_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown nothing"):
        ordered((Builtin(family="a", after=("nothing",)),))
    with pytest.raises(ValueError, match="cycle: a, b"):
        ordered((Builtin(family="a", after=("b",)), Builtin(family="b", after=("a",))))


def test_hook_points_are_named_not_positional() -> None:
    with pytest.raises(TypeError):
        Builtin("a", ("b",))  # type: ignore[call-arg]


@dataclass
class _Counting:
    asked: int = 0

    def __call__(self, config: Config) -> bool:
        self.asked += 1
        return True


def test_what_a_generation_uses_is_settled_once(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = _Counting()
    monkeypatch.setattr(built_ins, "BUILTINS", (Builtin(family="counted", in_use=counting),))
    generation = cast(Generation, type("G", (), {"config": built_ins.parse(""), "state": Kept()})())
    for _ in range(5):
        assert [b.family for b in built_ins.in_use(generation)] == ["counted"]
        built_ins.before(generation)
        built_ins.growth(generation)
    assert counting.asked == 1


def test_what_a_built_in_keeps_is_made_once_and_of_its_type() -> None:
    made: list[int] = []

    def make() -> list[int]:
        made.append(1)
        return []

    key = Key("counts", make)
    kept = Kept()
    kept.get(key).append(3)
    assert kept.get(key) == [3] and made == [1]
    assert Kept().get(key) == [] and made == [1, 1]  # each holder its own
    assert "counts" in repr(kept)
