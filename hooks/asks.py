"""What a built-in's move asks the next generation's fits for: one type per ask, declared here beside the built-in
interface (hooks/registry.py), so that a fit reads the asks it knows by their type and never another family's
own. A move asks through wrapper/reload_ask.py with `asking(...)`; a fit reads with `asked(asks, Kind)`.

    ask_reload(host, why, asking(Projector(wanted=True)))
    asked(asks, Projector)          # Projector(wanted=True), or None when nobody asked
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from wrapper.launching.launch import Asks

T = TypeVar("T")


@dataclass(frozen=True)
class MemoryMove:
    """A move of degrade's along its ladder, made for memory. Media gives an unused projector up for it unless
    it is a move `up`; a move up with `projector` takes back the projector given up for memory."""

    up: bool = False
    projector: bool = False


@dataclass(frozen=True)
class Projector:
    """Media's own move: the projector loaded (`wanted`) or dropped."""

    wanted: bool


@dataclass(frozen=True)
class Draft:
    """Spec's own move: speculative decoding in the argv (`running`) or left out."""

    running: bool


def asking(*asks: Any) -> dict[type[Any], Any]:
    """The asks of one move, each under its type."""
    return {type(ask): ask for ask in asks}


def asked(asks: Asks, kind: type[T]) -> T | None:
    """The ask of that type, None when the move did not make one."""
    found = asks.get(kind)
    return found if isinstance(found, kind) else None
