"""What each slot of one llama-server holds, as far as the wrapper knows: one owner, changed only through its own
methods, each named by what happened (a slot served a request, was saved, restored into, or is unknown now).

A slot is *unchanged* when the store holds exactly what it holds (the entry it was saved as or restored
from): a stop or a leaving conversation then writes nothing. That is only trusted once the book is *pinned*
(`pinned()`: every completion goes to the slot the conversation cache chose for it); otherwise a request may
have run in any slot.

The slot built-ins and the conversation cache change the book; the other built-ins read it through `SlotsView`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from wrapper.generation import Generation
from wrapper.kept import Key

_TIMINGS = {key: re.compile(rb'"' + key.encode() + rb'"\s*:\s*(\d+)') for key in ("cache_n", "prompt_n", "predicted_n")}


def left_in_slot(tail: bytes) -> int | None:
    """The tokens a completion answer leaves in its slot, from its end (the last `timings`: cache_n + prompt_n +
    predicted_n, what it generated included); None without timings."""
    found = {key: pattern.findall(tail) for key, pattern in _TIMINGS.items()}
    if not found["prompt_n"]:
        return None
    return sum(int(values[-1]) for values in found.values() if values)


class SlotsView(Protocol):
    """The book as the other built-ins see it: read-only."""

    def holds(self, slot: int) -> list[int]: ...

    def tokens_per_slot(self) -> dict[int, int]: ...


@dataclass
class SlotBook:
    _total: int = 0  # -np as the server reports it, once asked
    _exact: bool = False  # every completion is pinned (the conversation cache): the book is what the slots hold
    _state_version: int | None = None  # the slot-file version this server writes, once learnt
    _tokens: dict[int, list[int]] = field(default_factory=dict)
    _entry: dict[int, str] = field(default_factory=dict)  # the entry holding exactly what the slot holds
    _from_store: set[int] = field(default_factory=set)  # slots holding what a restore put there, unchanged
    _partial: set[int] = field(default_factory=set)  # slots that hold more than their tokens here say (a turn went
    # on there untold, or something unknown): a conversation taking such a slot saves it first
    _chain: dict[int, object] = field(default_factory=dict)  # the conversation cache's chain of the slot's last
    # request (hooks/conversations/chain.py): what it holds goes on from there

    # -- reading ------------------------------------------------------------------------------------------------

    @property
    def total(self) -> int:
        return self._total

    @property
    def exact(self) -> bool:
        return self._exact

    @property
    def state_version(self) -> int | None:
        return self._state_version

    def holds(self, slot: int) -> list[int]:
        return self._tokens.get(slot, [])

    def known(self) -> dict[int, list[int]]:
        return dict(self._tokens)

    def tokens_per_slot(self) -> dict[int, int]:
        return {slot: len(tokens) for slot, tokens in self._tokens.items()}

    def entry_of(self, slot: int) -> str | None:
        """The entry that holds exactly what the slot holds, when that is known."""
        return self._entry.get(slot) if self._exact else None

    def partial(self, slot: int) -> bool:
        """Whether the slot may hold more than `holds` says: its tokens are only a prefix of what it holds (a turn
        went on there untold), or unknown (a request that failed, or one the server placed itself)."""
        return slot in self._partial

    def restored_unchanged(self, slot: int) -> bool:
        """Whether the slot holds what a restore put there, no request served since."""
        return slot in self._from_store

    def chain_of(self, slot: int) -> object | None:
        """The chain of the request the slot served last, while it holds that request's conversation."""
        return self._chain.get(slot)

    def slots(self) -> range:
        return range(max(1, self._total, *(s + 1 for s in self._tokens)))

    # -- what the server said -----------------------------------------------------------------------------------

    def learnt_total(self, total: int) -> None:
        self._total = total

    def learnt_version(self, version: int) -> None:
        self._state_version = version

    def pinned(self) -> None:
        """Every completion is pinned to its slot from now on: the book says what the slots hold."""
        self._exact = True

    # -- what happened to a slot --------------------------------------------------------------------------------

    def served(self, slot: int, tokens: list[int] | None, chain: object | None = None) -> None:
        """A request ran there: it holds its tokens (and what it generated, which the next turn repeats), or
        something unknown (None: a request that failed may have left part of it). `chain`: the request's."""
        if tokens is None:
            self._tokens.pop(slot, None)
            self._partial.add(slot)
        else:
            self._tokens[slot] = tokens
            self._partial.discard(slot)
        self._set_chain(slot, chain if tokens is not None else None)
        self._entry.pop(slot, None)
        self._from_store.discard(slot)

    def continued(self, slot: int, chain: object, reused: int) -> None:
        """A request that went on from what the slot held ran there (its tokens were not told): the server kept
        the first `reused` tokens of what the slot held, so the book's tokens up to there are still what it holds
        first (the rest of it is not known token by token)."""
        if len(self.holds(slot)) > reused:
            self._tokens[slot] = self._tokens[slot][:reused]
        self._set_chain(slot, chain)
        self._partial.add(slot)
        self._entry.pop(slot, None)
        self._from_store.discard(slot)

    def _set_chain(self, slot: int, chain: object | None) -> None:
        if chain is None:
            self._chain.pop(slot, None)
        else:
            self._chain[slot] = chain

    def saved(self, slot: int, tokens: list[int], key: str) -> None:
        self._tokens[slot], self._entry[slot] = tokens, key
        self._partial.discard(slot)

    def restored(self, slot: int, tokens: list[int], key: str | None) -> None:
        """`key` None: what it came from is not an entry (a pair of the earlier layout): the next save writes it."""
        self._tokens[slot] = tokens
        self._chain.pop(slot, None)
        self._partial.discard(slot)
        self._from_store.add(slot)
        if key is None:
            self._entry.pop(slot, None)
        else:
            self._entry[slot] = key

    def forgotten(self) -> None:
        """A request the server put in a slot of its own choosing: any slot may hold something else now (each is
        saved before a conversation takes it)."""
        self._partial.update(self.slots())
        self._tokens.clear()
        self._entry.clear()
        self._chain.clear()
        self._from_store.clear()


_KEY = Key("slots.book", SlotBook)


def book_of(generation: Generation) -> SlotBook:
    return generation.state.get(_KEY)


def view_of(generation: Generation) -> SlotsView:
    """What each slot of the generation holds, for a built-in that only reads it."""
    return book_of(generation)
