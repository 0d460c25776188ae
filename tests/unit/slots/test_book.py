"""What each slot holds, one owner: a slot is unchanged only while the store holds exactly what it holds."""

from __future__ import annotations

from hooks.slots.book import SlotBook


def test_a_slot_is_unchanged_from_its_save_or_restore_until_it_serves() -> None:
    book = SlotBook()
    book.learnt_total(2)
    book.pinned()
    book.restored(0, [1, 2, 3], "k0")
    book.saved(1, [4, 5], "k1")
    assert (book.entry_of(0), book.entry_of(1)) == ("k0", "k1")
    book.served(0, [1, 2, 3, 4])
    assert book.entry_of(0) is None and book.holds(0) == [1, 2, 3, 4]  # the next save writes it
    book.served(1, None)  # a request that failed may have left part of it
    assert book.holds(1) == [] and book.entry_of(1) is None


def test_a_restore_of_what_is_not_an_entry_is_saved_next_time() -> None:
    book = SlotBook()
    book.pinned()
    book.restored(0, [1, 2], None)  # a pair of the earlier layout
    assert book.holds(0) == [1, 2] and book.entry_of(0) is None


def test_without_pinned_requests_nothing_is_taken_as_unchanged() -> None:
    book = SlotBook()  # not pinned: a request may have run in any slot
    book.saved(0, [1], "k0")
    assert book.entry_of(0) is None
    book.pinned()
    book.forgotten()  # a request the server put where it chose
    assert book.entry_of(0) is None and book.known() == {} and list(book.slots()) == [0]


def test_the_other_built_ins_read_tokens_per_slot() -> None:
    book = SlotBook()
    book.served(0, [1, 2, 3])
    book.restored(2, [4], "k")
    assert book.tokens_per_slot() == {0: 3, 2: 1}


def test_a_slot_whose_conversation_went_on_keeps_what_the_server_reused_of_its_tokens() -> None:
    book = SlotBook()
    book.pinned()
    book.saved(0, [1, 2, 3, 4], "k0")
    book.answered(0, 14, reused=10)  # the server kept all of it and went on: still a prefix of it
    book.continued(0, "chain-2")
    assert book.holds(0) == [1, 2, 3, 4] and book.chain_of(0) == "chain-2" and book.entry_of(0) is None
    book.answered(0, 9, reused=2)  # a template that wrote the history another way: only 2 kept
    book.continued(0, "chain-3")
    assert book.holds(0) == [1, 2] and book.chain_of(0) == "chain-3" and book.count(0) == 9
    book.continued(0, "chain-4")  # no answer seen (an error, a cut): unknown
    assert book.holds(0) == [] and book.partial(0) and book.chain_of(0) is None


def test_a_slot_tells_its_chain_only_while_it_holds_that_request() -> None:
    book = SlotBook()
    book.served(0, [1, 2], "a")
    book.served(1, [3], "b")
    book.saved(0, [1, 2, 9], "k0")  # a save does not change what it holds
    assert (book.chain_of(0), book.chain_of(1)) == ("a", "b")
    book.restored(0, [5, 6], "k5")
    assert book.chain_of(0) is None
    book.served(1, None, "b")  # failed: unknown
    assert book.chain_of(1) is None
    book.served(1, [3, 4], "c")
    book.forgotten()
    assert book.chain_of(1) is None and book.holds(1) == []


def test_a_slot_restored_at_the_start_is_told_until_it_serves() -> None:
    book = SlotBook()
    book.restored(0, [1, 2], "k0")
    book.saved(0, [1, 2], "k0")  # saved again unchanged: still what the restore put there
    assert book.restored_unchanged(0)
    book.served(0, [1, 2, 3])
    assert not book.restored_unchanged(0)


def test_a_slot_holding_more_than_its_tokens_say_is_partial_until_saved() -> None:
    book = SlotBook()
    book.learnt_total(2)
    book.served(0, [1, 2], "a")
    assert not book.partial(0)
    book.answered(0, 7, reused=2)
    book.continued(0, "b")  # its next turn went on there untold
    assert book.partial(0) and book.holds(0) == [1, 2]
    book.saved(0, [1, 2, 3, 4], "k")
    assert not book.partial(0)
    book.served(1, None)  # a request that failed there: unknown
    assert book.partial(1)
    book.served(1, [5])
    book.forgotten()  # a request the server placed itself: every slot may hold anything
    assert book.partial(0) and book.partial(1)


def test_a_slot_holds_its_prompt_and_the_answer_it_generated() -> None:
    """A short question with a long answer: the book knows the question's tokens and how many the answer left."""
    book = SlotBook()
    book.pinned()
    book.answered(0, 344, reused=0)  # seen in the answer's timings, before the request is released
    book.served(0, list(range(44)), "a")
    assert book.holds(0) == list(range(44)) and book.count(0) == 344 and book.held() == {0: 344}
    book.served(0, list(range(50)))  # an answer not seen (no timings): its tokens only
    assert book.count(0) == 50
    book.answered(1, 300, reused=None)
    assert book.held() == {0: 50, 1: 300}  # counted at once: what degrade sizes a context by
    book.saved(1, list(range(300)), "k")
    assert book.count(1) == 300 and book.entry_of(1) == "k"


def test_a_slot_knows_whose_conversation_it_holds() -> None:
    book = SlotBook()
    book.learnt_total(3)
    book.served(0, [1, 2, 3], owner="alice")
    book.restored(1, [4, 5], "k1", "bob")
    assert (book.owner_of(0), book.owner_of(1), book.owner_of(2)) == ("alice", "bob", None)
    assert book.empty(2) and not book.empty(0)
    book.cut(0, [1], "")  # down to the public beginning: anyone's
    assert book.owner_of(0) == "" and book.holds(0) == [1]
    book.served(1, None, owner="bob")  # a request that failed: what it left is still bob's
    assert book.owner_of(1) == "bob" and not book.empty(1)
    book.forgotten()  # a request the server placed: nobody knows whose any slot is
    assert book.owner_of(0) is None and book.owner_of(1) is None and not book.empty(0)


def test_a_forgotten_conversations_slot_stays_to_erase_until_erased() -> None:
    """A forget found a request of that consumer's running in the slot: the request's end (served), another
    request the server placed itself (every slot forgotten by the book) leave it to be erased; only the erase ends
    it."""
    book = SlotBook()
    book.learnt_total(2)
    book.served(0, [1, 2, 3], owner="alice")
    book.erase_later(0)
    book.served(0, [1, 2, 3, 4], owner="alice")
    book.forgotten()
    assert book.to_erase(0) and not book.to_erase(1)
    book.erased(0)
    assert not book.to_erase(0) and book.empty(0)
