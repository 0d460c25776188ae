"""What each slot of one llama-server holds, as far as the wrapper knows: one owner, changed only by what
happened to a slot (it served a request, it was saved, restored into, or is unknown now).

A slot is *unchanged* when the store holds exactly what it holds (the entry it was saved as or restored
from): a stop or a leaving conversation then writes nothing. That is only trusted while every completion is
pinned to its slot (the conversation cache); otherwise a request may have run in any slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wrapper.generation import Generation
from wrapper.kept import Key


@dataclass
class SlotBook:
    total: int = 0  # -np as the server reports it, once asked
    exact: bool = False  # every completion is pinned (the conversation cache): the book is what the slots hold
    state_version: int | None = None  # the slot-file version this server writes, once learnt
    _held: dict[int, list[int]] = field(default_factory=dict)
    _entry: dict[int, str] = field(default_factory=dict)  # the entry holding exactly what the slot holds

    def holds(self, slot: int) -> list[int]:
        return self._held.get(slot, [])

    def known(self) -> dict[int, list[int]]:
        return dict(self._held)

    def entry_of(self, slot: int) -> str | None:
        """The entry that holds exactly what the slot holds, when that is known."""
        return self._entry.get(slot) if self.exact else None

    def slots(self) -> range:
        return range(max(1, self.total, *(s + 1 for s in self._held)))

    def served(self, slot: int, tokens: list[int] | None) -> None:
        """A request ran there: it holds its tokens (and what it generated, which the next turn repeats), or
        something unknown (None: a request that failed may have left part of it)."""
        if tokens is None:
            self._held.pop(slot, None)
        else:
            self._held[slot] = tokens
        self._entry.pop(slot, None)

    def saved(self, slot: int, tokens: list[int], key: str) -> None:
        self._held[slot], self._entry[slot] = tokens, key

    def restored(self, slot: int, tokens: list[int], key: str | None) -> None:
        """`key` None: what it came from is not an entry (a pair of the earlier layout): the next save writes it."""
        self._held[slot] = tokens
        if key is None:
            self._entry.pop(slot, None)
        else:
            self._entry[slot] = key

    def forgotten(self) -> None:
        """A request the server put in a slot of its own choosing: any slot may hold something else now."""
        self._held.clear()
        self._entry.clear()


_KEY = Key("slots.book", SlotBook)


def book_of(generation: Generation) -> SlotBook:
    return generation.state.get(_KEY)
