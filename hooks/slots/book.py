"""What each slot of one llama-server holds, as far as the wrapper knows: one owner, changed only through its own
methods, each named by what happened (a slot served a request, was saved, restored into, or is unknown now).

A slot is *unchanged* when the store holds exactly what it holds (the entry it was saved as or restored
from): a stop or a leaving conversation then writes nothing. That is only trusted once the book is *pinned*
(`pinned()`: every completion goes to the slot the conversation cache chose for it); otherwise a request may
have run in any slot.

It is the one record of what a slot holds: its tokens as far as they are known (a prompt's, a save's, a restore's),
and how many it holds (what the last answer left there: its prompt and what it generated, from the answer's
timings, whose token ids are not known). The slot built-ins and the conversation cache change the book; the other
built-ins read it through `SlotsView`.
"""

from __future__ import annotations

import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol

from wrapper import paths
from wrapper.kept import Key
from wrapper.server.generation import Generation
from wrapper.steps import Observer

_TIMINGS = {key: re.compile(rb'"' + key.encode() + rb'"\s*:\s*(\d+)') for key in ("cache_n", "prompt_n", "predicted_n")}
_ID_SLOT = re.compile(rb'"id_slot"\s*:\s*(\d+)')

PINNED: ContextVar[int | None] = ContextVar("pinned", default=None)
"""The slot the request being answered was pinned to (set by the conversation cache's step, read when its answer
is seen: a task the request starts copies it)."""


def left_in_slot(tail: bytes) -> int | None:
    """The tokens a completion answer leaves in its slot, from its end (the last `timings`: cache_n + prompt_n +
    predicted_n, what it generated included); None without timings."""
    found = {key: pattern.findall(tail) for key, pattern in _TIMINGS.items()}
    if not found["prompt_n"]:
        return None
    return sum(int(values[-1]) for values in found.values() if values)


def reused_of(tail: bytes) -> int | None:
    """The tokens a completion answer took from what its slot held (its last `cache_n`); None without timings."""
    found = _TIMINGS["cache_n"].findall(tail)
    return int(found[-1]) if found else None


class SlotsView(Protocol):
    """The book as the other built-ins see it: read-only."""

    def holds(self, slot: int) -> list[int]: ...

    def held(self) -> dict[int, int]:
        """How many tokens each slot holds, as far as the book knows (its prompt and its answer)."""
        ...


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
    _count: dict[int, int] = field(default_factory=dict)  # how many tokens it holds, when more than its tokens say
    _answer: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # the answer just seen there: the tokens
    # it left in the slot and those it took from what the slot held, until the request that asked it is released
    _owner: dict[int, str] = field(default_factory=dict)  # the consumer whose conversation it holds (`consumers:`);
    # absent: nobody's (empty) or not known
    _unkeepable: set[int] = field(default_factory=set)  # untracked slots not worth a checkpoint: a save found too
    # little there, or what is there is no conversation (embeddings, rerank, infill)
    _changes: dict[int, int] = field(default_factory=dict)  # how often each slot's contents changed (a save tells the
    # book what it found only when nothing changed while it ran)
    _epoch: int = 0  # changes of every slot at once (forgotten)

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

    def held(self) -> dict[int, int]:
        return {slot: self.count(slot) for slot in {*self._tokens, *self._count}}

    def count(self, slot: int) -> int:
        """How many tokens the slot holds: its tokens, or more when an answer there generated more (whose ids are
        not known: the next turn repeats them)."""
        return max(len(self._tokens.get(slot, [])), self._count.get(slot, 0))

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

    def untracked(self) -> list[int]:
        """The slots whose contents the book lost track of (a request the server placed itself, an answer not seen),
        but those a save since found holding too little to keep."""
        return sorted(s for s in self._partial if s not in self._tokens and s not in self._unkeepable)

    def changes(self, slot: int) -> int:
        """A count that moves whenever what the slot holds changes (a request served or went on there, a restore, a
        cut, every slot forgotten)."""
        return self._epoch + self._changes.get(slot, 0)

    def owner_of(self, slot: int) -> str | None:
        """The consumer whose conversation the slot holds, when known (`consumers:`)."""
        return self._owner.get(slot)

    def empty(self, slot: int) -> bool:
        """Whether the slot is known to hold nothing."""
        return not self.count(slot) and slot not in self._partial

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

    def answered(self, slot: int, left: int, reused: int | None) -> None:
        """An answer came from the slot: it left `left` tokens there (its prompt and what it generated), of which
        `reused` were what the slot held before; which tokens they are is told when the request is released
        (`served`, `continued`)."""
        self._answer[slot] = (left, reused)
        self._count[slot] = left

    def served(self, slot: int, tokens: list[int] | None, chain: object | None = None,
               owner: str | None = None) -> None:
        """A request ran there: it holds its tokens and what it generated (as many as its answer left, when seen:
        the next turn repeats them), or something unknown (None: a request that failed may have left part of
        it). `chain`: the request's; `owner`: its consumer."""
        self._owned(slot, owner)
        self._changed(slot)
        left = self._answer.pop(slot, (0, None))[0]
        if tokens is None:
            self._tokens.pop(slot, None)
            self._count.pop(slot, None)
            self._partial.add(slot)
        else:
            self._tokens[slot] = tokens
            self._counted(slot, left)
            self._partial.discard(slot)
        self._set_chain(slot, chain if tokens is not None else None)
        self._entry.pop(slot, None)
        self._from_store.discard(slot)

    def continued(self, slot: int, chain: object) -> None:
        """A request that went on from what the slot held ran there (its tokens were not told): the server kept the
        first tokens its answer says it reused of what the slot held, so the book's tokens up to there are still
        what it holds first (the rest is not known token by token). An answer not seen (an error, a cut, no
        timings) leaves it unknown."""
        left, reused = self._answer.pop(slot, (0, None))
        if reused is None:
            self.served(slot, None)
            return
        self._changed(slot)
        if len(self.holds(slot)) > reused:
            self._tokens[slot] = self._tokens[slot][:reused]
        self._counted(slot, left)
        self._set_chain(slot, chain)
        self._partial.add(slot)
        self._entry.pop(slot, None)
        self._from_store.discard(slot)

    def cut(self, slot: int, tokens: list[int], owner: str | None) -> None:
        """The slot was cut down to `tokens` (a public beginning, or nothing) for `owner`'s request."""
        self.served(slot, tokens, None, owner)
        self._count.pop(slot, None)

    def _owned(self, slot: int, owner: str | None) -> None:
        if owner is None:
            self._owner.pop(slot, None)
        else:
            self._owner[slot] = owner

    def _counted(self, slot: int, left: int) -> None:
        if left > len(self._tokens.get(slot, [])):
            self._count[slot] = left
        else:
            self._count.pop(slot, None)

    def _set_chain(self, slot: int, chain: object | None) -> None:
        if chain is None:
            self._chain.pop(slot, None)
        else:
            self._chain[slot] = chain

    def unkeepable(self, slot: int) -> None:
        """The untracked slot is not worth a checkpoint until it serves again: a save kept nothing (too short), or
        the request that left it was no conversation."""
        self._unkeepable.add(slot)

    def _changed(self, slot: int) -> None:
        self._changes[slot] = self._changes.get(slot, 0) + 1
        self._unkeepable.discard(slot)

    def saved(self, slot: int, tokens: list[int], key: str) -> None:
        self._tokens[slot], self._entry[slot] = tokens, key
        self._count.pop(slot, None)
        self._partial.discard(slot)

    def restored(self, slot: int, tokens: list[int], key: str | None, owner: str | None = None) -> None:
        """`key` None: what it came from is not an entry (a pair of the earlier layout): the next save writes it.
        `owner`: the consumer the entry is of."""
        self._owned(slot, owner)
        self._changed(slot)
        self._tokens[slot] = tokens
        self._count.pop(slot, None)
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
        self._count.clear()
        self._answer.clear()
        self._entry.clear()
        self._chain.clear()
        self._from_store.clear()
        self._owner.clear()
        self._unkeepable.clear()
        self._epoch += 1


_KEY = Key("slots.book", SlotBook)


def book_of(generation: Generation) -> SlotBook:
    return generation.state.get(_KEY)


def view_of(generation: Generation) -> SlotsView:
    """What each slot of the generation holds, for a built-in that only reads it."""
    return book_of(generation)


def observer(generation: Generation) -> Observer:
    """What an answer left in its slot (the slot it was pinned to, else the one it names), told to the book."""
    book = book_of(generation)

    def seen(path: str, status: int, tail: bytes) -> None:
        if status != 200 or path not in paths.CONVERSING:
            return
        left, slot = left_in_slot(tail), PINNED.get()
        if slot is None and (named := _ID_SLOT.findall(tail)):
            slot = int(named[-1])
        if left is not None and slot is not None:
            book.answered(slot, left, reused_of(tail))

    return seen
