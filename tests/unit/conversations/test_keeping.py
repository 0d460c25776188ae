"""What the slots hold is kept before it is taken away, whatever happens in between: a state machine (hypothesis) drives
the slot book and the keep-first rule (`policy.needs_no_keeping`, what hooks/conversations/moves.py's `leave` and
`take` ask before a prompt, a cut or room in the KV) through random sequences of several consumers' turns in any slot
(chat, Responses and Messages turns take the same way), requests the server places itself, restores, checkpoints,
cuts, stops and starts, crashes, and forgets, beside a model of what llama-server's slots and the store hold.

Checked after every step:
- no conversation's reusable tokens (the longest prefix of it a slot or the store holds) shrink, but by a forget, a
  crash (bounded next), or less than cache.min_tokens (not worth a save);
- the book's `unkept` never says less than what a crash now would lose of a slot (what it holds beyond the store)."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hooks.conversations.policy import needs_no_keeping
from hooks.slots.book import SlotBook
from hooks.store import common_prefix

MIN = 32  # cache.min_tokens
SLOTS = 3
SYSTEM = list(range(8))  # the system prompt every conversation begins with
CONSUMERS = ("alice", "bob")


class Keeping(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.server: dict[int, list[int]] = {s: [] for s in range(SLOTS)}  # what llama-server's slots hold
        self.store: dict[str, tuple[list[int], str | None]] = {}  # entry -> its tokens and whose
        self.notes: dict[int, str] = {}  # this host's note: the entry each slot held at its last checkpoint
        self.conversations: list[tuple[str, list[int]]] = []  # whose, and what the last turn left (prompt + answer)
        self.fresh = 1000
        self.book = self._new_book()
        self.reusable: list[int] = []
        self.shrinks: set[int] = set()  # conversations that may shrink at this step (a forget)

    @staticmethod
    def _new_book() -> SlotBook:
        book = SlotBook()
        book.learnt_total(SLOTS)
        book.pinned()
        return book

    def _tokens(self, n: int) -> list[int]:
        self.fresh += n
        return list(range(self.fresh - n, self.fresh))

    # -- the moves, as the wrapper makes them ---------------------------------------------------------------------

    def _save(self, slot: int) -> str | None:
        held = self.server[slot]
        if len(held) < MIN:  # a save of a state this short keeps nothing
            if slot in self.book.untracked():
                self.book.unkeepable(slot)
            return None
        key = f"e{hash(tuple(held))}"
        self.store[key] = (list(held), self.book.owner_of(slot))
        self.book.saved(slot, list(held), key)
        return key

    def _keep_first(self, slot: int, tokens: list[int]) -> None:
        """moves.leave: what `tokens` drop of what the slot holds is saved first, unless the rule says why not."""
        if needs_no_keeping(self.book, slot, tokens, MIN, lambda key: key in self.store) is None:
            self._save(slot)

    def _restore(self, slot: int, tokens: list[int]) -> None:
        """moves.bring_back: the entry sharing the longest prefix, when it wins MIN tokens over the slot."""
        best = max(self.store.items(), key=lambda kv: common_prefix(kv[1][0], tokens), default=None)
        if best is None:
            return
        key, (held, owner) = best
        if common_prefix(held, tokens) - common_prefix(self.server[slot], tokens) >= MIN:
            self.server[slot] = list(held)
            self.book.restored(slot, list(held), key, owner)

    # -- what clients and the server do ---------------------------------------------------------------------------

    @initialize()
    def begin(self) -> None:
        self.reusable = []

    @rule(consumer=st.sampled_from(CONSUMERS), length=st.integers(1, 120))
    def new_conversation(self, consumer: str, length: int) -> None:
        self.conversations.append((consumer, [*SYSTEM, *self._tokens(length)]))
        self.reusable.append(0)

    @precondition(lambda self: self.conversations)
    @rule(data=st.data(), slot=st.integers(0, SLOTS - 1), said=st.integers(1, 60), answer=st.integers(1, 40))
    def turn(self, data: st.DataObject, slot: int, said: int, answer: int) -> None:
        """A turn of a conversation pinned to a slot (a chat request, a Responses one; a Messages one where the
        server's rule puts it): what leaves the slot kept first, the conversation restored, the answer left there."""
        n = data.draw(st.integers(0, len(self.conversations) - 1))
        consumer, before = self.conversations[n]
        prompt = [*before, *self._tokens(said)] if len(before) > len(SYSTEM) else before
        self._keep_first(slot, prompt)
        self._restore(slot, prompt)
        reused = common_prefix(self.server[slot], prompt)
        self.server[slot] = [*prompt, *self._tokens(answer)]
        self.book.answered(slot, len(self.server[slot]), reused)
        self.book.served(slot, prompt, owner=consumer)
        self.conversations[n] = (consumer, list(self.server[slot]))

    @rule(slot=st.integers(0, SLOTS - 1), length=st.integers(1, 80))
    def placed_by_the_server(self, slot: int, length: int) -> None:
        """An embedding, rerank or infill request: where the server puts it cannot be foretold, so every idle slot
        holding what the store does not keep is kept first (placed.keep_idle); then it replaces one slot's contents."""
        for each, unkept in self.book.unkept().items():
            if unkept:
                self._keep_first(each, [])
        self.server[slot] = self._tokens(length)
        self.book.served(slot, None)
        self.book.unkeepable(slot)

    @rule(slot=st.integers(0, SLOTS - 1))
    def checkpoint(self, slot: int) -> None:
        """checkpoints: a slot grown past the threshold is saved again and noted."""
        if self.book.unkept().get(slot, 0) >= 2 * MIN and (key := self._save(slot)) is not None:
            self.book.kept(slot, self.book.holds(slot), len(self.server[slot]))
            self.notes[slot] = key

    @rule(slot=st.integers(0, SLOTS - 1), keep=st.integers(0, 40))
    def cut(self, slot: int, keep: int) -> None:
        """moves.take: a cut for another consumer's request (to a beginning), or room in the KV (to nothing)."""
        left = self.server[slot][:keep] if keep > 1 else []
        self._keep_first(slot, left)
        self.server[slot] = left
        self.book.cut(slot, left, None)

    @rule()
    def stop_and_start(self) -> None:
        """A swap: slots.save keeps every slot, the next server's slots.restore puts them back."""
        for slot in range(SLOTS):
            if self.server[slot] and (key := self._save(slot)) is not None:
                self.notes[slot] = key
        self._restart()

    @rule()
    def crash(self) -> None:
        """llama-server killed: what the slots held is gone; the checkpoints' notes come back. What the book said was
        unkept is what may be lost."""
        for n, (_, tokens) in enumerate(self.conversations):
            from_store = max((common_prefix(held, tokens) for held, _ in self.store.values()), default=0)
            lost = self.reusable[n] - from_store
            if lost > 0:
                slot = max(range(SLOTS), key=lambda s: common_prefix(self.server[s], tokens))
                assert lost <= self.book.unkept().get(slot, 0) or lost < MIN, (n, lost, self.book.unkept())
        self._restart()
        self.reusable = [self._reusable(tokens) for _, tokens in self.conversations]

    @rule(consumer=st.sampled_from(CONSUMERS))
    def forget(self, consumer: str) -> None:
        """DELETE /wrapper/conversations: its entries and its slots erased, on purpose."""
        self.store = {k: v for k, v in self.store.items() if v[1] != consumer}
        for slot in range(SLOTS):
            if self.book.owner_of(slot) == consumer:
                self.server[slot] = []
                self.book.erased(slot)
        self.shrinks = {n for n, (whose, _) in enumerate(self.conversations) if whose == consumer}

    def _restart(self) -> None:
        self.server = {s: [] for s in range(SLOTS)}
        self.book = self._new_book()
        for slot, key in self.notes.items():
            if key in self.store:
                held, owner = self.store[key]
                self.server[slot] = list(held)
                self.book.restored(slot, list(held), key, owner)

    # -- what must hold ------------------------------------------------------------------------------------------

    def _reusable(self, tokens: list[int]) -> int:
        return max([common_prefix(held, tokens) for held in self.server.values()]
                   + [common_prefix(held, tokens) for held, _ in self.store.values()])

    @invariant()
    def nothing_kept_shrinks(self) -> None:
        now = [self._reusable(tokens) for _, tokens in self.conversations]
        for n, (was, is_) in enumerate(zip(self.reusable, now, strict=False)):
            assert n in self.shrinks or is_ > was - MIN, (n, was, is_, self.server, self.book.known())
        self.reusable, self.shrinks = now, set()

    @invariant()
    def unkept_is_what_a_crash_would_lose(self) -> None:
        for slot, said in self.book.unkept().items():
            held = self.server[slot]
            in_store = max((common_prefix(kept, held) for kept, _ in self.store.values()), default=0)
            assert len(held) - in_store <= said, (slot, len(held), in_store, said)


Keeping.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestKeeping = Keeping.TestCase


def test_the_rule_saves_an_unknown_slot_and_passes_over_what_is_kept_or_short() -> None:
    """needs_no_keeping, case by case."""
    book = SlotBook()
    book.learnt_total(2)
    book.pinned()
    book.answered(0, 300, 0)
    book.served(0, list(range(290)))
    assert needs_no_keeping(book, 0, [7, 8], MIN, lambda key: True) is None  # another conversation: saved first
    assert needs_no_keeping(book, 0, list(range(295)), MIN, lambda key: True) is not None  # it goes on: no loss
    book.saved(0, list(range(300)), "e0")
    assert needs_no_keeping(book, 0, [7, 8], MIN, lambda key: key == "e0") == "kept as it stands"
    assert needs_no_keeping(book, 0, [7, 8], MIN, lambda key: False) is None  # its entry evicted: saved again
    book.served(1, None)
    assert needs_no_keeping(book, 1, [7, 8], MIN, lambda key: True) is None  # unknown: a save tells
    book.cut(1, list(range(10)), None)
    reason: Any = needs_no_keeping(book, 1, [7, 8], MIN, lambda key: True)
    assert reason is not None and "shorter" in reason
