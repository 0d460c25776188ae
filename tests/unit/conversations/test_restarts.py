"""Where the next turn goes after a restart, decided from the book of the server that serves it (a table): the book
is written as the wrapper writes it — a restore at the start, what an answer left in a slot (the observer), the
release of the request that ran there — and the next turn goes on in the slot that holds its conversation
(policy.goes_on_in) or is looked up (policy.choose_slot)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from hooks.conversations.chain import Messages, messages_of
from hooks.conversations.policy import choose_slot, goes_on_in
from hooks.slots.book import SlotBook
from hooks.store.interface import common_prefix

MIN_TOKENS = 256
SYSTEM = list(range(1000, 1050))  # a template's first tokens, shared by every conversation


def turn(*said: str) -> list[dict[str, str]]:
    roles = ("user", "assistant")
    return [{"role": roles[n % 2], "content": text} for n, text in enumerate(said)]


def messages(*said: str) -> Messages:
    found = messages_of({"messages": turn(*said)})
    assert found is not None
    return found


def tokens(name: str, n: int) -> list[int]:
    """A conversation's tokens: the shared template start, then its own."""
    return SYSTEM + [hash((name, k)) % 50_000 for k in range(n - len(SYSTEM))]


QUESTION = ("a long story", "once upon a time", "tell me more")  # the turn that was cut, and its answer
NEXT = messages(*QUESTION, "the whole story", "and then?")  # the next turn: the history, the whole answer, a question
ASKED = tokens("A", 2_144)  # the cut turn's prompt
GOING_ON = ASKED + tokens("A answer", 80)[len(SYSTEM):]  # ... and the text its client had: the continuation's prompt
LEFT = len(GOING_ON) + 200  # what the continued answer left in its slot (its prompt and what it generated)
OTHER = tokens("B", 1_500)  # another conversation, kept in the store


@dataclass
class Case:
    slots: int
    book: Callable[[SlotBook], None]  # what the wrapper told the new server's book, in order
    kept: list[list[int]] = field(default_factory=list)  # the store's entries
    busy: set[int] = field(default_factory=set)


def stepped_again(slot: int, prompt: list[int], reused: int) -> Callable[[SlotBook], None]:
    """A request that went on on this server after its steps ran again here: the lookup pinned it (its tokens
    known), the observer saw what its answer left, the release recorded its conversation."""
    def told(book: SlotBook) -> None:
        book.answered(slot, LEFT, reused)
        book.served(slot, prompt, messages(*QUESTION).chain())
    return told


def not_stepped_again(slot: int, reused: int) -> Callable[[SlotBook], None]:
    """What the book was told before: the continuation ran on the new server with the first run's reservation (it
    went on in its slot on the old server: its tokens were never told)."""
    def told(book: SlotBook) -> None:
        book.answered(slot, LEFT, reused)
        book.continued(slot, messages(*QUESTION).chain())
    return told


def then(*steps: Callable[[SlotBook], None]) -> Callable[[SlotBook], None]:
    def told(book: SlotBook) -> None:
        for step in steps:
            step(book)
    return told


def restored(slot: int, held: list[int], key: str) -> Callable[[SlotBook], None]:
    return lambda book: book.restored(slot, held, key)


def paused_in(slot: int) -> Callable[[SlotBook], None]:
    """A background answer paused there: its slot saved and let go (hooks/conversations/step.py's _keep)."""
    def told(book: SlotBook) -> None:
        book.served(slot, None)
        book.saved(slot, GOING_ON, "paused")
    return told


CASES = {
    # a crash mid-stream at -np 2, nothing kept (no checkpoint, the store empty): the continuation's steps ran
    # again on the new server and pinned it to the slot its client had asked none of
    "crash, nothing kept, -np 2": (Case(2, stepped_again(0, GOING_ON, 0)), 0, "goes on"),
    "crash, nothing kept, -np 4": (Case(4, stepped_again(2, GOING_ON, 0)), 2, "goes on"),
    "crash, nothing kept, -np 1": (Case(1, stepped_again(0, GOING_ON, 0)), 0, "goes on"),
    # another conversation in the store: it begins with the template's first tokens only
    "crash, another conversation kept": (Case(2, stepped_again(0, GOING_ON, 0), kept=[OTHER]), 0, "goes on"),
    # the issue's run: the book knew slot 0's conversation but none of its tokens, and anything kept (here another
    # conversation) might be a longer state of it: the lookup took the least recently used slot, which held nothing
    "before: not stepped again, another kept": (Case(2, then(not_stepped_again(0, 0)), kept=[OTHER]), 1, "looked up"),
    # the conversation's checkpoint restored at the start into slot 1: the continuation's lookup found it there
    "crash, its checkpoint restored": (
        Case(2, then(restored(1, ASKED[:1_900], "ckpt"), stepped_again(1, GOING_ON, 1_900)), kept=[ASKED[:1_900]]),
        1, "goes on"),
    # a longer state of it in the store than the slot holds (another host went on with it): the lookup weighs it
    "a longer state kept": (Case(2, stepped_again(0, GOING_ON, 0), kept=[GOING_ON + list(range(400))]), 0,
                            "looked up"),
    # a JSON answer sent again whole after a crash: its steps ran again, its own prompt's tokens
    "crash under a JSON answer": (Case(2, stepped_again(1, ASKED, 0)), 1, "goes on"),
    # a background answer paused in slot 0 and resumed in slot 1 (its steps ran again for the resume)
    "paused and resumed elsewhere": (Case(2, then(paused_in(0), stepped_again(1, GOING_ON, len(GOING_ON)))), 1,
                                     "goes on"),
    # a reload handed the stream over: the new server got every slot back, the steps ran again there
    "a reload's hand-over": (Case(2, then(restored(0, OTHER, "b"), restored(1, ASKED, "a"),
                                          stepped_again(1, GOING_ON, len(ASKED)))), 1, "goes on"),
    # no restart: a turn that went on in its slot without a lookup keeps what the server reused of it
    "no crash, went on in its slot": (
        Case(2, then(lambda book: book.served(0, ASKED, messages(*QUESTION[:1]).chain()), not_stepped_again(0, 2_000))),
        0, "goes on"),
    # the slot is taken by another request of ours: looked up (and queued behind it by choose_slot's caller)
    "its slot busy": (Case(2, stepped_again(0, GOING_ON, 0), busy={0}), 1, "looked up"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_next_turn_after_a_restart(name: str) -> None:
    case, slot, how = CASES[name]
    book = SlotBook()
    book.learnt_total(case.slots)
    book.pinned()
    case.book(book)

    def longer_kept(known: list[int], n: int) -> bool:
        return any(len(entry) >= n and entry[:len(known)] == known for entry in case.kept)

    found = goes_on_in(book, case.busy, None, NEXT, MIN_TOKENS, longer_kept)
    if found is not None:
        assert (found, "goes on") == (slot, how), name
        return
    free = [s for s in range(case.slots) if s not in case.busy]
    request = GOING_ON + tokens("A next", 300)[len(SYSTEM):]
    last_used = {s: float(s == 0) for s in range(case.slots)}  # slot 0 served last (the cut turn's first run)
    chosen = choose_slot(free, book.known(), request, last_used, MIN_TOKENS)
    assert (chosen, "looked up") == (slot, how), (name, common_prefix(book.holds(chosen), request))
