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

from hooks.store import common_prefix
from wrapper import paths
from wrapper.kept import Key
from wrapper.server.generation import Generation
from wrapper.steps import Observer

_TIMINGS = {key: re.compile(rb'"' + key.encode() + rb'"\s*:\s*(\d+)') for key in ("cache_n", "prompt_n", "predicted_n")}
_USAGE = {key: re.compile(rb'"' + key.encode() + rb'"\s*:\s*(\d+)')
          for key in ("cache_read_input_tokens", "input_tokens", "output_tokens", "cached_tokens")}
_ID_SLOT = re.compile(rb'"id_slot"\s*:\s*(\d+)')

PINNED: ContextVar[int | None] = ContextVar("pinned", default=None)
"""The slot the request being answered was pinned to (set by the conversation cache's step, read when its answer
is seen: a task the request starts copies it)."""


def _last(found: dict[str, list[bytes]], key: str) -> int | None:
    return int(found[key][-1]) if found.get(key) else None


def _usage(tail: bytes) -> tuple[int, int] | None:
    """(left, reused) from a Messages or Responses answer's usage, when it has no `timings`: Messages counts the
    prompt as `cache_read_input_tokens` + `input_tokens`, Responses as `input_tokens` of which `cached_tokens`."""
    found = {key: pattern.findall(tail) for key, pattern in _USAGE.items()}
    read, given, output = (_last(found, k) for k in ("cache_read_input_tokens", "input_tokens", "output_tokens"))
    if given is None or output is None:
        return None
    if read is not None:
        return read + given + output, read
    cached = _last(found, "cached_tokens")
    return (given + output, cached) if cached is not None else None


def left_in_slot(tail: bytes) -> int | None:
    """The tokens a completion answer leaves in its slot, from its end (the last `timings`: cache_n + prompt_n +
    predicted_n, what it generated included; else a Messages or Responses answer's usage); None without them."""
    found = {key: pattern.findall(tail) for key, pattern in _TIMINGS.items()}
    if not found["prompt_n"]:
        usage = _usage(tail)
        return usage[0] if usage is not None else None
    return sum(int(values[-1]) for values in found.values() if values)


def reused_of(tail: bytes) -> int | None:
    """The tokens a completion answer took from what its slot held (its last `cache_n`, else its usage's cached
    tokens); None without them."""
    found = _TIMINGS["cache_n"].findall(tail)
    if found:
        return int(found[-1])
    usage = _usage(tail)
    return usage[1] if usage is not None else None


class SlotsView(Protocol):
    """The book as the other built-ins see it: read-only."""

    def holds(self, slot: int) -> list[int]: ...

    def held(self) -> dict[int, int]:
        """How many tokens each slot holds, as far as the book knows (its prompt and its answer)."""
        ...


@dataclass
class Slot:
    """What the book knows of one slot: one record, changed only through the book's methods."""

    tokens: list[int] | None = None  # its first tokens as far as they are known (a prompt's, a save's, a restore's)
    count: int = 0  # how many tokens it holds, when more than `tokens` says (an answer's, whose ids are not known)
    entry: str | None = None  # the entry holding exactly what the slot holds
    from_store: bool = False  # it holds what a restore put there, unchanged
    partial: bool = False  # it holds more than its tokens say (a turn went on there untold, or something unknown):
    # a conversation taking it saves it first
    chain: object | None = None  # the conversation cache's chain of its last request (hooks/conversations/chain.py)
    answer: tuple[int, int | None] | None = None  # the answer just seen there: the tokens it left and those it took
    # from what the slot held, until the request that asked it is released
    owner: str | None = None  # the consumer whose conversation it holds (`consumers:`); None: nobody's or not known
    unkeepable: bool = False  # untracked, and not worth a checkpoint: a save found too little there, or what is
    # there is no conversation (embeddings, rerank, infill)
    changes: int = 0  # how often its contents changed (a save tells the book what it found only when nothing
    # changed while it ran)
    kept: tuple[list[int], int] | None = None  # (its prompt, the tokens it held) when it was last kept: what a
    # crash now would not lose of it (a checkpoint, a save as it left)
    to_erase: bool = False  # its consumer was forgotten while a request ran there: never saved, erased once free

    @property
    def held(self) -> int:
        return max(len(self.tokens or ()), self.count)


@dataclass
class SlotBook:
    _total: int = 0  # -np as the server reports it, once asked
    _exact: bool = False  # every completion is pinned (the conversation cache): the book is what the slots hold
    _state_version: int | None = None  # the slot-file version this server writes, once learnt
    _slots: dict[int, Slot] = field(default_factory=dict)
    _epoch: int = 0  # changes of every slot at once (forgotten)

    def _at(self, slot: int) -> Slot:
        return self._slots.setdefault(slot, Slot())

    def _of(self, slot: int) -> Slot:
        return self._slots.get(slot) or Slot()

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
        return self._of(slot).tokens or []

    def known(self) -> dict[int, list[int]]:
        return {slot: record.tokens for slot, record in sorted(self._slots.items()) if record.tokens is not None}

    def tokens_per_slot(self) -> dict[int, int]:
        return {slot: len(tokens) for slot, tokens in self.known().items()}

    def held(self) -> dict[int, int]:
        return {slot: record.held for slot, record in sorted(self._slots.items())
                if record.tokens is not None or record.count}

    def count(self, slot: int) -> int:
        """How many tokens the slot holds: its tokens, or more when an answer there generated more (whose ids are
        not known: the next turn repeats them)."""
        return self._of(slot).held

    def entry_of(self, slot: int) -> str | None:
        """The entry that holds exactly what the slot holds, when that is known."""
        return self._of(slot).entry if self._exact else None

    def partial(self, slot: int) -> bool:
        """Whether the slot may hold more than `holds` says: its tokens are only a prefix of what it holds (a turn
        went on there untold), or unknown (a request that failed, or one the server placed itself)."""
        return self._of(slot).partial

    def restored_unchanged(self, slot: int) -> bool:
        """Whether the slot holds what a restore put there, no request served since."""
        return self._of(slot).from_store

    def untracked(self) -> list[int]:
        """The slots whose contents the book lost track of (a request the server placed itself, an answer not seen),
        but those a save since found holding too little to keep."""
        return [s for s, r in sorted(self._slots.items()) if r.partial and r.tokens is None and not r.unkeepable]

    def changes(self, slot: int) -> int:
        """A count that moves whenever what the slot holds changes (a request served or went on there, a restore, a
        cut, every slot forgotten)."""
        return self._epoch + self._of(slot).changes

    def owner_of(self, slot: int) -> str | None:
        """The consumer whose conversation the slot holds, when known (`consumers:`)."""
        return self._of(slot).owner

    def empty(self, slot: int) -> bool:
        """Whether the slot is known to hold nothing."""
        record = self._of(slot)
        return not record.held and not record.partial

    def to_erase(self, slot: int) -> bool:
        """Whether the slot holds a forgotten consumer's conversation that a request still runs in: nothing saves
        it, and no request of ours takes it until it is erased (`erased`)."""
        return self._of(slot).to_erase

    def chain_of(self, slot: int) -> object | None:
        """The chain of the request the slot served last, while it holds that request's conversation."""
        return self._of(slot).chain

    def kept_as(self, slot: int) -> tuple[list[int], int] | None:
        """(its prompt, the tokens it held) when the slot was last kept; None: never since it was forgotten."""
        return self._of(slot).kept

    def unkept(self) -> dict[int, int]:
        """Each slot's tokens the store does not keep: what a crash now would prefill again (0: its conversation is
        kept as it stands, restored unchanged or saved since it last grew). Untracked slots are not counted (what
        they hold is not known)."""
        return {slot: 0 if self.entry_of(slot) is not None or record.from_store else
                max(0, grown(record.kept, tokens, record.held)) for slot, record in sorted(self._slots.items())
                if (tokens := record.tokens) is not None}

    def slots(self) -> range:
        return range(max(1, self._total, *(s + 1 for s, r in self._slots.items() if r.tokens is not None)))

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
        record = self._at(slot)
        record.answer, record.count = (left, reused), left

    def served(self, slot: int, tokens: list[int] | None, chain: object | None = None,
               owner: str | None = None) -> None:
        """A request ran there: it holds its tokens and what it generated (as many as its answer left, when seen:
        the next turn repeats them), or something unknown (None: a request that failed may have left part of
        it). `chain`: the request's; `owner`: its consumer."""
        record = self._changed(slot)
        left = record.answer[0] if record.answer is not None else 0
        record.answer, record.owner, record.tokens = None, owner, tokens
        record.count = left if tokens is not None and left > len(tokens) else 0
        record.partial = tokens is None
        if tokens is None or (record.kept is not None and common_prefix(record.kept[0], tokens) < len(record.kept[0])):
            record.kept = None  # not known, or another conversation: nothing of what it holds counts as kept
        record.chain = chain if tokens is not None else None
        record.entry, record.from_store = None, False

    def continued(self, slot: int, chain: object) -> None:
        """A request that went on from what the slot held ran there (its tokens were not told): the server kept the
        first tokens its answer says it reused of what the slot held, so the book's tokens up to there are still
        what it holds first (the rest is not known token by token). An answer not seen (an error, a cut, no
        timings) leaves it unknown."""
        record = self._at(slot)
        left, reused = record.answer if record.answer is not None else (0, None)
        if reused is None:
            self.served(slot, None)
            return
        self._changed(slot)
        record.answer = None
        if record.tokens is not None and len(record.tokens) > reused:
            record.tokens = record.tokens[:reused]
        record.count = left if left > len(record.tokens or ()) else 0
        record.chain, record.partial = chain, True
        record.entry, record.from_store = None, False

    def cut(self, slot: int, tokens: list[int], owner: str | None) -> None:
        """The slot was cut down to `tokens` (a public beginning, or nothing) for `owner`'s request: nothing of what
        it holds now counts as kept (the entry it was kept as may be another consumer's, and forgotten)."""
        self.served(slot, tokens, None, owner)
        record = self._at(slot)
        record.count, record.kept = 0, None

    def unkeepable(self, slot: int) -> None:
        """The untracked slot is not worth a checkpoint until it serves again: a save kept nothing (too short), or
        the request that left it was no conversation."""
        self._at(slot).unkeepable = True

    def _changed(self, slot: int) -> Slot:
        record = self._at(slot)
        record.changes += 1
        record.unkeepable = False
        return record

    def saved(self, slot: int, tokens: list[int], key: str) -> None:
        record = self._at(slot)
        record.tokens, record.entry, record.count, record.partial = tokens, key, 0, False
        record.kept = (tokens, len(tokens))

    def kept(self, slot: int, prompt: list[int], held: int) -> None:
        """The slot's conversation is kept as it stands (a checkpoint): `prompt` the tokens the book knew it held
        first, `held` how many it held."""
        self._at(slot).kept = (prompt, held)

    def restored(self, slot: int, tokens: list[int], key: str | None, owner: str | None = None) -> None:
        """`key` None: what it came from is not an entry (a pair of the earlier layout): the next save writes it.
        `owner`: the consumer the entry is of."""
        record = self._changed(slot)
        record.owner, record.tokens, record.count, record.chain = owner, tokens, 0, None
        record.partial, record.from_store, record.entry = False, True, key
        record.kept = (tokens, len(tokens))

    def erase_later(self, slot: int) -> None:
        """A forget found a request running there: what the slot holds is erased once it is free (`to_erase`)."""
        self._at(slot).to_erase = True

    def erased(self, slot: int) -> None:
        """The slot holds nothing now (a forget)."""
        self.cut(slot, [], "")
        self._at(slot).to_erase = False

    def forgotten(self) -> None:
        """A request the server put in a slot of its own choosing: any slot may hold something else now (each is
        saved before a conversation takes it)."""
        for slot in self.slots():
            self._at(slot)
        for record in self._slots.values():
            record.tokens, record.count, record.answer, record.entry, record.chain = None, 0, None, None, None
            record.partial, record.from_store, record.owner, record.unkeepable = True, False, None, False
            record.kept = None
        self._epoch += 1


def grown(kept_as: tuple[list[int], int] | None, prompt: list[int], held: int) -> int:
    """How much a slot holding `held` tokens for `prompt` grew since it was kept as `kept_as` (its prompt then,
    the tokens it held then): from what it held when this conversation goes on from that one, else from what
    the two share (another conversation took the slot)."""
    if kept_as is None:
        return held
    kept_prompt, kept_held = kept_as
    shared = common_prefix(kept_prompt, prompt)
    return held - (kept_held if shared == len(kept_prompt) else shared)


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
