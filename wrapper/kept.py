"""What built-ins keep, typed: each declares a `Key` with the class of what it keeps and how to make it; a
generation's `state` (one server's life) and `shared` (the wrapper's whole life) are `Kept` holders of them.

    BOOK = Key("slots.book", SlotBook)
    book = generation.state.get(BOOK)      # a SlotBook, made on first use
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Key(Generic[T]):
    """One built-in's kept value: its name (for messages) and what makes it on first use."""

    name: str
    make: Callable[[], T]


class Kept:
    """Values by key, each made once on first use and of the key's type."""

    def __init__(self) -> None:
        self._held: dict[Key[Any], Any] = {}

    def get(self, key: Key[T]) -> T:
        if key not in self._held:
            self._held[key] = key.make()
        return cast(T, self._held[key])

    def settle(self, key: Key[T], make: Callable[[], T]) -> T:
        """The value, made by `make` the first time it is asked for (a value that depends on the holder's owner)."""
        if key not in self._held:
            self._held[key] = make()
        return cast(T, self._held[key])

    def __repr__(self) -> str:
        return f"Kept({', '.join(key.name for key in self._held)})"
